"""Capture arenas in memory the store process can map (worker/results/store_process.py): with
ACTQ_STORE_PROCESS on, a job's arena (worker/hooks/capture.py) is a memfd mapped here, so its rows
reach the stored file without another copy in the engine's process: the store process is handed
the memfd and reads each captured tensor's column range out of it.

A region lives as long as any tensor viewing it (torch.frombuffer holds the mapping); its memfd
is closed, and forgotten here, when the mapping is freed."""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import torch

_enabled = False
_lock = threading.Lock()
_regions: dict[int, tuple[int, int]] = {}  # a region's address -> (its memfd, its bytes)


def enable() -> None:
    """Arenas made from now on are shared (the store process runs)."""
    global _enabled
    _enabled = True


def empty(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised `[rows, columns]` CPU tensor: in a shared region when enabled (and not empty)."""
    size = rows * columns * torch.empty((), dtype=dtype).element_size()
    if not _enabled or size == 0:
        return torch.empty((rows, columns), dtype=dtype, device="cpu")
    fd = os.memfd_create("actq-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        region = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(region, dtype=dtype, count=rows * columns).view(rows, columns)
    address = tensor.data_ptr()
    with _lock:
        _regions[address] = (fd, size)
    weakref.finalize(region, _forget, address, fd)
    return tensor


def _forget(address: int, fd: int) -> None:
    with _lock:
        if _regions.get(address, (None,))[0] == fd:
            del _regions[address]
    os.close(fd)


def region_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(memfd, bytes) of the shared region `tensor` views, or None (not in one)."""
    if tensor.device.type != "cpu":
        return None
    with _lock:
        return _regions.get(tensor.untyped_storage().data_ptr())

"""Freed memory given back to the system: glibc keeps freed heap blocks (a process's resident size
would ratchet up to its largest job or its largest KV cache) and PyTorch's CUDA allocator keeps
freed device blocks cached, until asked."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

import torch

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def release_memory() -> None:
    """Give the heap memory freed so far back to the system: `malloc_trim` walks every arena of the
    heap, each locked meanwhile (a thread allocating in one waits): 1-1.5 ms of CPU on 2 cores
    while capture jobs finish, tens of microseconds on a small heap. Jobs finishing one after
    another call `release_memory_soon`."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only (not musl)
    if trim is not None:
        trim(0)


TRIM_INTERVAL_S = 0.5  # `release_memory_soon`: at most one trim per interval


class _Trims:
    lock = threading.Lock()
    last = float("-inf")  # when the last trim began (monotonic)
    due = False  # a trim is set for the interval's end


def release_memory_soon() -> None:
    """`release_memory` now, or, within TRIM_INTERVAL_S of the last trim, once at that interval's
    end (one timer however many jobs end meanwhile): a bulk run's jobs, ending many per second,
    trim twice a second rather than each, and the memory the last of them freed is still given back
    within the interval. Never blocks the caller on a trim in progress."""
    with _Trims.lock:
        now = time.monotonic()
        wait = _Trims.last + TRIM_INTERVAL_S - now
        if _Trims.due:
            return
        if wait > 0:
            _Trims.due = True
            timer = threading.Timer(wait, _trim_due)
            timer.daemon = True
            timer.start()
            return
        _Trims.last = now
    release_memory()


def _trim_due() -> None:
    with _Trims.lock:
        _Trims.due = False
        _Trims.last = time.monotonic()
    release_memory()


def release_device_memory(device: torch.device) -> None:
    """`release_memory`, and on a GPU the allocator's cached blocks that nothing uses."""
    release_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()

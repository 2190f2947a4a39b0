"""Freed memory given back to the system: glibc keeps freed heap blocks (a process's resident size
would ratchet up to its largest job or its largest KV cache) and PyTorch's CUDA allocator keeps
freed device blocks cached, until asked."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def release_memory() -> None:
    """Give the heap memory freed so far back to the system. Tens of microseconds."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only (not musl)
    if trim is not None:
        trim(0)


def release_device_memory(device: torch.device) -> None:
    """`release_memory`, and on a GPU the allocator's cached blocks that nothing uses."""
    release_memory()
    if device.type == "cuda":
        torch.cuda.empty_cache()

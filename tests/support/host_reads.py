"""Counting host reads of tensor values: each one waits for the device on a GPU. Used by
bench/bench_step.py and tests/gpu (a decoding step's host synchronisations)."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


class HostReads(TorchFunctionMode):
    """Counts reads of a tensor's values into Python (`.tolist()`, `.item()`, `int(t)`, `bool(t)`,
    ...): on a GPU each one waits for the device. The CPU profiler sees only some of them
    (`aten::_local_scalar_dense`), so they are counted at the Python boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))

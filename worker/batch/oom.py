"""The one out-of-memory policy for a pass or step over rows: when it runs out of memory, what it
wrote is put back, the device's cached memory is given back, and the rows run again in two
halves, each under the same policy, down to one row, which then fails alone (`OutOfMemory`); the
first split lowers the batch's cap (later batches stay at the half). Every runner of rows uses it:
the compacting batch's steps (worker/batch/decoding.py), the slots' eager steps
(worker/batch/slot_decoding.py), the state slots' steps (worker/batch/state_decoding.py), and the
engine core's trace passes and prefill passes (worker/engine/core.py; a prefill splits on any
failure, not only out of memory). Any other exception propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from worker.rules.failures import is_oom

log = logging.getLogger(__name__)
R = TypeVar("R")


def release_cached() -> None:
    """After running out of memory: the device's cached blocks back, so that what runs next finds room."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def lowered_cap(most_rows: int | None, rows: int, what: str) -> int:
    """A batch's cap once a `what` of `rows` rows ran out of memory: the half, said in the log."""
    half = rows // 2
    log.warning("out of memory at a %s of %d: running it in halves; batches now at most %d", what, rows, half)
    return min(most_rows or rows, half)


def in_halves(
    lo: int,
    hi: int,
    run: Callable[[int, int], R],
    fail: Callable[[int, int, Exception], R],
    undo: Callable[[int, int], None] | None = None,
    split: Callable[[int], None] | None = None,
    splits: Callable[[Exception], bool] = is_oom,
) -> list[R]:
    """`run(lo, hi)` over rows [lo, hi) under the policy (see the module): the answers of the parts
    that ran, in row order. `undo(lo, hi)` puts back what a run that ran out of memory wrote (when
    it fails, those rows fail with its error: `fail(lo, hi, exc)`); a lone row out of memory is
    `fail(i, i + 1, exc)`; `split(rows)` is told at the first split only (the batch's cap).
    `splits`: which failures run the rows again in halves (out of memory; a prefill also splits on
    any failure, so that one job's own failure is found in a few passes and fails that job alone)."""
    try:
        return [run(lo, hi)]
    except Exception as exc:
        if not splits(exc):
            raise
        oom = exc
    if undo is not None:
        try:
            undo(lo, hi)
        except Exception as exc:  # noqa: BLE001 - what the pass wrote cannot be put back: its rows fail
            return [fail(lo, hi, exc)]
    release_cached()
    if hi - lo == 1:
        return [fail(lo, hi, oom)]
    half = lo + (hi - lo) // 2
    if split is not None:
        split(hi - lo)
    return in_halves(lo, half, run, fail, undo, splits=splits) + in_halves(half, hi, run, fail, undo, splits=splits)


def stitched(parts: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor | None:
    """The logits of rows run in parts (`in_halves`), in row order: each part's `[n, V]`, zeros for
    a part that failed (its rows are ended, never read); None when every part failed."""
    present = [logits for logits, _ in parts if logits is not None]
    if not present:
        return None
    if len(parts) == 1:
        return present[0]
    width = present[0].shape[1]
    return torch.cat([got if got is not None else present[0].new_zeros(n, width) for got, n in parts])

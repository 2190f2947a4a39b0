"""A slots step's log-probabilities, for the rows that asked: computed on the device as the step is
launched (`score_step`, before the step after may overwrite the logits buffer) and copied to the
host beside its tokens, then recorded when its tokens are read (`take_scores`). Nothing waits for
the device in between, so a batch with log-probabilities keeps its step overlap
(worker/batch/slot_decoding.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.batch.sequence import Sequence, record_scores, score_table
from worker.rules.failures import failure_of


@dataclass
class Scored:
    """A step's log-probabilities for slots `slots`: a `score_table` of width `k` on its way to the
    host, or the `error` computing it raised."""

    slots: list[int]
    k: int
    table: torch.Tensor | None = None
    error: Exception | None = None


def score_step(logits: torch.Tensor, tokens: torch.Tensor, owners: list[Sequence | None]) -> Scored | None:
    """The step's scores from its logits `[slots, V]` and chosen tokens `[slots]` (on the device)
    for the owners that asked (None when none did). Never raises: an error is the rows'."""
    slots = [slot for slot, s in enumerate(owners) if s is not None and s.scores is not None]
    if not slots:
        return None
    k = max(owners[slot].scores.k for slot in slots)  # type: ignore[union-attr]
    try:
        index = torch.tensor(slots, device=logits.device)
        table = score_table(logits[index], tokens[index], k)
        return Scored(slots, k, table.to("cpu", non_blocking=True))
    except Exception as exc:  # noqa: BLE001 - the rows that asked fail when their tokens are read
        return Scored(slots, k, error=exc)


def take_scores(scored: Scored | None, owners: list[Sequence | None], tokens: list[int]) -> None:
    """Each still running row's scores recorded, the step's tokens read (`tokens`, per slot); if
    they could not be computed or read, the rows that asked for them fail."""
    if scored is None:
        return
    live: list[tuple[int, Sequence]] = []
    for i, slot in enumerate(scored.slots):
        row = owners[slot]
        if row is not None and row.ended is None and row.scores is not None:
            live.append((i, row))
    if not live:
        return
    try:
        if scored.error is not None:
            raise scored.error
        assert scored.table is not None
        host = scored.table.tolist()
        picked = [tokens[scored.slots[i]] for i, _ in live]
        record_scores([row.scores for _, row in live], picked, [host[i] for i, _ in live], scored.k)  # type: ignore[misc]
    except Exception as exc:  # noqa: BLE001 - scoring failed: the rows that asked for it fail
        failure = failure_of(exc)
        for _, row in live:
            row.failure, row.ended = failure, "failed"

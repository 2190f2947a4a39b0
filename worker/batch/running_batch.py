"""The running batch as the engine core and the scheduler see it: the one interface of the
compacting batch (worker/batch/decoding.py), the slots (worker/batch/slot_decoding.py) and one job at a time
(worker/batch/solo.py). Which one serves a model is worker/batch/served.py's choice; nothing that drives
a batch depends on which."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from worker.batch.sequence import Feeding, Sequence


class RunningBatch(Protocol):
    """One model's running batch, driven by one thread (the engine core)."""

    rows: list[Sequence]  # the sequences decoding now
    most_rows: int | None  # the most rows a step may run (lowered after out of memory; None: no cap)
    chunk_tokens: int | None  # prompts longer than this are fed in chunks (`feed`); None: never

    def admit_many(self, seqs: list[Sequence]) -> None:
        """Prefill `seqs` in one pass and let those their first token did not end join. All or
        nothing: on failure every sequence is as before the call."""

    def trace(self, seqs: list[Sequence]) -> None:
        """One forward pass over each trace sequence's text: each ends "trace" or "failed"."""

    def feed(self, item: Feeding, most: int) -> bool:
        """The next `most` positions of a long text; True once it is all fed (and joined or ended)."""
        ...

    def step(self) -> list[Sequence]:
        """One decoding step of every running row; returns the rows that ended."""
        ...

    def reset(self) -> None:
        """Drop the running rows (after a failed step answered them)."""

    def close(self) -> None:
        """Hooks removed, memory let go."""

    def wants_logits(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt pass needs every position's logits (it prefills apart)."""
        ...

    def must_wait(self, joining: list[Sequence]) -> bool:
        """Whether `joining` must wait for running rows to leave (the KV cache's byte cap)."""
        ...

    def idle(self) -> None:
        """Nothing runs: a chance to give memory back."""

    def cache_size(self) -> tuple[int, int, int]:
        """The KV cache held between steps: (bytes, slots, positions per slot)."""
        ...

"""The capture path and the edit path: the one interface each that a decoder calls at a forward
pass, whatever the pass (a prefill, a prompt chunk, a trace, a decoding step) and whatever the
batch (the slots, the compacting batch, a solo job).

A pass goes `begin` (the rows it runs and what each feeds: `PassRows`), `record` (a context around
the model's forward pass: the values are captured and edited inside it), then `finish` once the
pass succeeded (its captured rows count, its gates' positions are kept). `hand_over` gives the
captured steps to their jobs (rows leave), `discard` forgets what a failed batch recorded, `close`
takes every hook off the model. Every prefill, prompt chunk and trace pass and the compacting
batch's steps go through it (worker/batch/batch_passes.py). The decoding steps of the slots and of
the recurrent-state slots (worker/batch/slot_decoding.py, worker/batch/state_decoding.py) call the
table operations by their own names (`keys`, `hand_over`, `recording`, `advance`, `stepped` of the
rings; `sync`, `plan`, `recording`, `collect` of the tables): a step run in halves after running
out of memory records one ring row over its parts, and the slots' graphs are recorded with them.

The path: table operations on the step. worker/hooks/step_capture.py (`StepRings`) writes every
captured value of a decoding step into a device ring with one `index_copy_` at a device cursor,
at each row's slot; worker/hooks/step_edits.py (`StepEdits`) applies each row's edits from
per-slot tables with `torch.where`, the ops of worker/hooks/edit_ops.py. Neither reads the host
inside the pass, so the slots' step replays as a CUDA graph whether it captures and edits or not.
Both serve every model family's decoding steps: attention models in the KV slots, recurrent and
hybrid models (Mamba, Mamba-2, Jamba, GraniteMoeHybrid, Qwen3-Next, LFM2, RecurrentGemma) in the
state slots, whose rows keep their slots in another order (`recording(..., slots)`).

The fallback: per-module hooks, worker/hooks/capture_hooks.py (`BatchHooks`) and worker/hooks/edits.py
(`BatchEdits`), behind the same interface, applying the same ops. These passes need it, and why:
- every prefill, prompt chunk and trace pass: its rows are not slot rows yet (a prefill runs with a
  cache of its own before its rows join the slots), feed many positions each (`[B, S, W]`,
  left-padded), and the tables index rows by slot and read one position per row;
- every pass of the compacting batch (worker/batch/decoding.py: models whose cache cannot live in
  slots) and of the one-job-at-a-time decoder (worker/batch/solo.py: a batch of one, or a cache
  that cannot batch): their rows have no slot, so there is no table row to index;
- a decoding step whose rows carry an edit the tables cannot hold (`step_edits.fits`: a patch that
  reaches a decoding position, an edit over more than `SPANS` position intervals): that step runs
  eagerly with `BatchEdits` (its captures still go to the rings).
What blocks the prefill from the tables: the table operations take a row's table index from its
slot and its position from a `[slots, 1]` state. A prefill would need, per pass, a device tensor
of each row's table index and a `[B, S]` tensor of each column's position (padding masked), table
rows for jobs not yet in a slot, and flags from position 0 for gated edits at the prompt (their
reports count step 0). The rings hold one position per slot and step (`[steps, slots, W]`): a
prefill's S positions per row would need a ring row per position, handed over apart from the
steps' windows. Until then the fallback serves them, exact against forward hooks like the path
(tests/worker/test_hook_paths.py drives both through this interface).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shared.errors import JobFailure
    from worker.hooks.capture import JobCapture
    from worker.hooks.edits import JobEdits


@dataclass(frozen=True)
class PassRows:
    """What a forward pass feeds: row b, slot `lo + b` of the slots (`lo` is 0 outside them), feeds
    positions [start, start + n) = `spans[b]`, right-aligned in the pass's `width` columns (a
    left-padded prefill); `decoding`: a decoding step, one new position per row."""

    spans: list[tuple[int, int]]
    width: int
    decoding: bool = False
    lo: int = 0

    @property
    def rows(self) -> int:
        return len(self.spans)

    @property
    def lengths(self) -> list[int] | None:
        """Each row's own positions (its last ones), or None when every row fills the pass."""
        counts = [n for _, n in self.spans]
        return None if all(n == self.width for n in counts) else counts

    @staticmethod
    def step(positions: list[int], lo: int = 0) -> PassRows:
        """A decoding step: row b feeds position `positions[b]`."""
        return PassRows([(p, 1) for p in positions], 1, decoding=True, lo=lo)


@runtime_checkable
class CapturePath(Protocol):
    """What a decoder does with the rows' captures at a forward pass (see the module)."""

    def begin(self, rows: list[JobCapture | None], at: PassRows) -> None:
        """Before the pass: `rows` (one per row of `at`; None captures nothing)."""

    def record(self, at: PassRows) -> AbstractContextManager[object]:
        """Around the model's forward pass: each row's values captured as the modules return them."""

    def finish(self) -> dict[int, JobFailure]:
        """After the pass succeeded: its values count. Returns the rows (by index) whose capture
        failed (its rows did not fit); the others go on."""

    def hand_over(self) -> None:
        """Every recorded step to its job now (rows leave, the batch ends); a job's result waits
        for what is on its way (`JobCapture.settle`)."""

    def discard(self) -> None:
        """Forget what was recorded and not yet handed over (the batch failed as a whole)."""

    def close(self) -> None:
        """Every hook off the model."""


@runtime_checkable
class EditPath(Protocol):
    """What a decoder does with the rows' edits at a forward pass (see the module)."""

    def begin(self, rows: list[JobEdits | None], at: PassRows) -> None:
        """Before the pass: `rows` (one per row of `at`; None edits nothing)."""

    def record(self, at: PassRows) -> AbstractContextManager[object]:
        """Around the model's forward pass: each row's edits applied at the positions it selects."""

    def finish(self) -> None:
        """After the pass succeeded: where its gated edits fired is kept (their reports)."""

    def close(self) -> None:
        """Every hook off the model."""

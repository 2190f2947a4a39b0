"""A prompt pass's captured rows, gathered per (module, hook) for every job of the pass at once and
handed to each job in one copy: the prefill's counterpart of the decoding steps' windows
(worker/hooks/step_capture.py `Block`).

Without it a prompt pass of B jobs capturing K modules cost K x B Python calls and copies (each job
its own rows of each module, `JobCapture.keep`); with it, K gathers while the pass runs (each
module's kept rows of every job, side by side in one block) and B copies after it, one per job
into its arena (`apply`, `JobCapture.keep_pass`). The block holds only the rows the jobs keep: a
`generated` capture keeps each prompt's last position, `all` or `prompt` every prompt position.

It serves the first pass of jobs whose prompt the pass feeds whole (not a chunk of it) and whose
rows are copied as they are (no reduction, not `last`); a module whose value is not one row per
position of the pass (`lm_head` computed at the last position only, a flattened batch) is left to
`JobCapture.keep`, job by job, which says what does not fit. Nothing reaches a job before the pass
returned: a pass that fails (out of memory, then run in halves) leaves every job as it was.
"""

from __future__ import annotations

import math

import torch

from shared.errors import JobFailure
from worker.hooks.capture import JobCapture
from worker.hooks.paths import PassRows

Key = tuple[str, str]  # (module path, "output" | "input")
# The most a block holds: on a GPU it lives on the device until the pass returned. A pass keeping
# more (every prompt position of long prompts at many modules) keeps its rows job by job, straight
# to each job's arena on the host, as before there were blocks.
BLOCK_BYTES = 32 << 20


class PassBlock:
    """One prompt pass's kept rows: `rows[r0 : r0 + n]` are job j's positions [begin, begin + n),
    every key's values side by side in `columns[key] = (offset, width)`."""

    def __init__(
        self,
        jobs: list[tuple[int, JobCapture, int, int, int]],
        index: list[int],
        columns: dict[Key, tuple[int, int]],
        batch: int,
        width: int,
    ) -> None:
        self.jobs = jobs  # (row of the pass, its capture, its first block row, its first kept position, rows kept)
        self.index = index  # each block row's row in the pass's value flattened to [batch * width, W]
        self.columns = columns
        self.batch, self.width = batch, width
        self.total = sum(w for _, w in columns.values())
        self.rows: torch.Tensor | None = None  # [len(index), total], made at the first key taken
        self.taken: set[Key] = set()
        self._where: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def plan(captures: list[JobCapture | None], at: PassRows) -> PassBlock | None:
        """The block of a pass over `captures` feeding `at`, or None when the jobs' rows are kept
        one by one (a decoding step, a lone job, a chunk of a prompt, a reduction...)."""
        if at.decoding or sum(c is not None for c in captures) < 2:
            return None
        jobs: list[tuple[int, JobCapture, int, int, int]] = []
        index: list[int] = []
        widths: dict[Key, int] = {}
        for b, capture in enumerate(captures):
            if capture is None:
                continue
            start, fed = at.spans[b]
            simple = capture.reduce == "none" and capture.positions != "last" and capture.chunk is None
            if not simple or start != 0 or fed != capture.prompt_tokens or capture.failure is not None:
                return None
            for buffer in capture.buffers:
                key: Key = (buffer.point.module, buffer.point.hook)
                if buffer.steps != 0 or widths.setdefault(key, buffer.width) != buffer.width:
                    return None
            lo, hi = capture.window
            begin, stop = max(lo, 0), min(hi, fed)
            kept = max(0, stop - begin)
            base = b * at.width + at.width - fed  # the pass's row b, its first own position
            jobs.append((b, capture, len(index), begin, kept))
            index.extend(range(base + begin, base + begin + kept))
        columns: dict[Key, tuple[int, int]] = {}
        offset = 0
        for key in widths:  # the first job's order: a job capturing the same points copies its rows as they are
            columns[key] = (offset, widths[key])
            offset += widths[key]
        return PassBlock(jobs, index, columns, len(captures), at.width)

    def take(self, key: Key, value: torch.Tensor | None) -> bool:
        """Gather this key's kept rows of every job from the module's `value`; False (nothing
        taken) when the value is not `[batch, width, ...]` of the key's width, or of another
        dtype than the block's, or the block would hold more than BLOCK_BYTES: the jobs keep that
        key one by one."""
        found = self.columns.get(key)
        if found is None or key in self.taken or value is None or value.dim() < 3:
            return False  # (a module run twice in one pass: its jobs' buffers say so, one by one)
        offset, width = found
        if value.shape[0] != self.batch or value.shape[1] != self.width or math.prod(value.shape[2:]) != width:
            return False
        if self.rows is None:
            if len(self.index) * self.total * value.element_size() > BLOCK_BYTES:
                self.columns = {}  # too large: every key is kept job by job
                return False
            self.rows = torch.empty((len(self.index), self.total), dtype=value.dtype, device=value.device)
        if value.dtype != self.rows.dtype or value.device != self.rows.device:
            return False
        where = self._where.get(value.device)
        if where is None:
            where = self._where[value.device] = torch.tensor(self.index, dtype=torch.long, device=value.device)
        flat = value.reshape(self.batch * self.width, width)
        self.rows[:, offset : offset + width] = flat.index_select(0, where)
        self.taken.add(key)
        return True

    def apply(self, failures: dict[int, JobFailure]) -> None:
        """After the pass returned: each job's rows of the keys taken into its arena (one copy when
        every key of the job was taken), its buffers at the prompt's step. A job whose rows do not
        fit gets its failure in `failures` (by its row in the pass)."""
        if not self.taken:
            return
        assert self.rows is not None
        rows = self.rows if self.rows.device.type == "cpu" else self.rows.to("cpu")  # one copy to the host
        for b, capture, first, begin, kept in self.jobs:
            if b in failures:
                continue
            try:
                capture.keep_pass(rows[first : first + kept], begin, self.columns, self.taken)
            except JobFailure as exc:
                failures[b] = exc

"""The compacting running batch (`Decoder`), kept for the caches slots do not hold (sliding
windows): one timeline, where a sequence joins after its own prefill and leaves at the step it
ends, so a finished sequence frees its place for the next one at once. Its prefills, trace passes,
chunked prompts and row rules are every batch's (worker/batch/batch_passes.py); here is what compacts.

Each step feeds every sequence's newest token in one forward pass of `[B, 1]`. Prefilled rows'
cache rows are moved into the batch (worker/model/kvcache.py), left-padded to the batch's timeline. The
batch keeps, per sequence, the token ids, the attention mask (0 on padding) and position ids (each
sequence counts its own tokens from 0), all `[B, L]` with L = cached positions + 1 (the last column
is the token the next step feeds). Rows that end leave at once (`_keep`: the cache and columns
selected, common padding cropped); when that copy cannot be made, vacancies ride along.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from worker.batch.batch_passes import BatchPasses
from worker.batch.columns import append_column
from worker.batch.oom import in_halves, lowered_cap, stitched
from worker.batch.sequence import VACANT, Feeding, Sequence, Undo, Watch, vacancy
from worker.model import kvcache
from worker.rules.failures import failure_of, is_oom, out_of_memory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
# Moved to worker/batch/sequence.py; still importable from here for the modules that import them from here.
__all__ = ["Decoder", "Feeding", "Sequence", "Undo", "Watch"]


class Decoder(BatchPasses):
    """The compacting running batch of one model. Not thread-safe: one thread drives it (the engine core)."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, pad_id: int) -> None:
        super().__init__(model, tokenizer, pad_id)
        self.cache: Any = None
        self.ids = self.mask = self.pos = torch.empty(0, 0, dtype=torch.long)
        self.pads: list[int] = []  # each row's leading padding columns (kept on the host: no sync to ask)

    def _admit_many(self, seqs: list[Sequence]) -> None:
        cache, ids, mask, pos, pads = self._prompt_pass(seqs)
        width = ids.shape[1]
        going = [i for i, seq in enumerate(seqs) if not seq.ended]
        if not going:
            return
        if len(going) < len(seqs):  # some ended with their first token: only the others join
            cache = kvcache.select(cache, going, width)
            ids, mask, pos = ids[going], mask[going], pos[going]
        self._join([seqs[i] for i in going], cache, ids, mask, pos, [pads[i] for i in going])

    def _join(self, joining: list[Sequence], cache: Any, ids, mask, pos, pads: list[int]) -> None:
        """Add prefilled sequences (their first token chosen) to the running batch: `ids`, `mask`
        and `pos` `[n, width]` cover their prompts (`pads` leading padding columns each) and
        `cache` holds those `width` positions. All or nothing."""
        width = ids.shape[1]
        tokens = torch.tensor([[seq.generated[-1]] for seq in joining], dtype=ids.dtype, device=ids.device)
        ids = torch.cat([ids, tokens], 1)
        mask = torch.cat([mask, mask.new_ones(len(joining), 1)], 1)
        pos = torch.cat([pos, pos[:, -1:] + 1], 1)
        if not self.rows:
            self.rows, self.cache, self.ids, self.mask, self.pos, self.pads = joining, cache, ids, mask, pos, pads
            return
        # All or nothing: the new tensors first, then the cache (kvcache.concat puts every layer
        # back if it fails), then the swap; a failure leaves the running batch as it was.
        timeline = self.ids.shape[1]
        columns = max(timeline, width + 1)
        new_ids = torch.cat([self._pad(self.ids, columns, self.pad_id), self._pad(ids, columns, self.pad_id)])
        new_mask = torch.cat([self._pad(self.mask, columns, 0), self._pad(mask, columns, 0)])
        new_pos = torch.cat([self._pad(self.pos, columns, 0), self._pad(pos, columns, 0)])
        self.cache, _ = kvcache.concat([self.cache, cache], [timeline - 1, width])
        self.ids, self.mask, self.pos = new_ids, new_mask, new_pos
        self.pads = [pad + columns - timeline for pad in self.pads] + [pad + columns - (width + 1) for pad in pads]
        self.rows += joining

    def reset(self) -> None:
        """Drop the running batch (after a step failed: its rows were answered with the failure)."""
        super().reset()
        self.cache, self.pads = None, []
        self.ids, self.mask, self.pos = self.ids[:0], self.mask[:0], self.pos[:0]

    # -- one decoding step -----------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Feed every row's newest token; returns the rows that ended (already removed)."""
        if not self.rows:
            return []
        timeline = self.ids.shape[1] - 1
        logits, self.cache = self._run(timeline)
        if logits is not None:
            self._advance(self.rows, logits)
        ending = {i for i, row in enumerate(self.rows) if row.ended is not None and row.ended != VACANT}
        if ending:
            self.hooks.drain(ending, [row.capture for row in self.rows])  # the ending rows take their steps
            for row in self.rows:
                if row.failure is None and row.capture is not None and row.capture.failure is not None:
                    row.failure = row.capture.failure
                    row.ended = row.ended if row.ended is not None else "failed"
        tokens = [row.generated[-1] if row.generated else self.pad_id for row in self.rows]
        device = self.ids.device
        try:
            ids = append_column(self.ids, torch.tensor(tokens, dtype=self.ids.dtype, device=device))
            mask = append_column(self.mask, 1)
            pos = append_column(self.pos, self.pos[:, -1] + 1)
        except Exception as exc:  # noqa: BLE001 - rows that ended keep their results; the others cannot go on
            failure = failure_of(exc)
            for row in self.rows:
                if row.ended is None:
                    row.failure, row.ended = failure, "failed"
            ended = [row for row in self.rows if row.ended != VACANT]
            self.reset()
            return ended
        self.ids, self.mask, self.pos = ids, mask, pos
        return self._remove_ended()

    def _run(self, timeline: int) -> tuple[torch.Tensor | None, Any]:
        """One step of every row: (their logits `[B, V]`, or None when every row failed; the cache
        after it). Out of memory, worker/batch/oom.py's policy: what the pass wrote is put back (cache
        and captures), and the rows run in halves (each its rows of the step's cache), down to one
        row, which then fails alone (its logits row is zeros, unread)."""
        rows, cache, count = self.rows, self.cache, len(self.rows)
        self.hooks.settle([row.capture for row in rows])  # staged steps of another batch, before the marks
        saved = kvcache.snapshot(cache)
        marks = [row.capture.mark() if row.capture else None for row in rows]

        def run(lo: int, hi: int) -> tuple[torch.Tensor | None, Any, int, int]:
            part = cache if hi - lo == count else kvcache.select(cache, list(range(lo, hi)), timeline)
            ids, mask, pos = self.ids[lo:hi], self.mask[lo:hi], self.pos[lo:hi]
            logits = self._forward(ids, mask, pos, part, 1, rows[lo:hi], first=False, padded=any(self.pads[lo:hi]))
            return logits, part, timeline + 1, hi - lo

        def undo(lo: int, hi: int) -> None:
            if hi - lo == count:  # the step's own cache (the halves write into copies of their rows)
                kvcache.restore(cache, saved)
            for row, mark in zip(rows[lo:hi], marks[lo:hi], strict=True):
                if row.capture is not None and mark is not None:
                    row.capture.reset(mark)

        def fail(lo: int, hi: int, exc: Exception) -> tuple[torch.Tensor | None, Any, int, int]:
            if not is_oom(exc):
                raise exc
            for row in rows[lo:hi]:
                if row.ended is None:  # not a vacancy (nobody's row)
                    row.failure, row.ended = out_of_memory(), "failed"
            part = cache if hi - lo == count else kvcache.select(cache, list(range(lo, hi)), timeline)
            return None, part, timeline, hi - lo

        def split(size: int) -> None:
            self.most_rows = lowered_cap(self.most_rows, size, "batch")

        parts = in_halves(0, count, run, fail, undo, split)
        if len(parts) == 1:
            return parts[0][0], parts[0][1]
        merged, _ = kvcache.concat([part for _, part, _, _ in parts], [after for _, _, after, _ in parts])
        return stitched([(logits, n) for logits, _, _, n in parts]), merged

    def _row_ids(self, index: int) -> torch.Tensor:
        """Row `index`'s tokens so far `[1, n]`: a view of the batch's ids, without its padding."""
        return self.ids[index : index + 1, self.pads[index] :]

    def _remove_ended(self) -> list[Sequence]:
        """The rows that ended this step, out of the batch. Never raises: the ended rows are the
        answer whatever happens; if the smaller batch cannot be built (out of memory while copying
        the cache), each ended row's place is taken by a vacancy, a row that feeds padding and
        belongs to no job, and the next step tries again."""
        ended = [row for row in self.rows if row.ended is not None and row.ended != VACANT]
        if not ended:
            return []
        keep = [i for i, row in enumerate(self.rows) if row.ended is None]
        try:
            self._keep(keep)
        except Exception as exc:  # noqa: BLE001 - the batch goes on with vacancies
            log.warning(
                "could not shrink the batch (%s: %s): %d vacant rows ride along", type(exc).__name__, exc, len(ended)
            )
            self.rows = [row if row.ended is None or row.ended == VACANT else vacancy(self.pad_id) for row in self.rows]
        return ended

    def _keep(self, keep: list[int]) -> None:
        """The batch of rows `keep` only, built first and swapped in whole."""
        if not keep:
            self.reset()
            return
        timeline = self.ids.shape[1] - 1
        cache = kvcache.select(self.cache, keep, timeline)
        ids, mask, pos = self.ids[keep], self.mask[keep], self.pos[keep]
        pads = [self.pads[i] for i in keep]
        drop = min(pads)  # padding every remaining row has
        if drop:
            kvcache.crop_left(cache, drop, timeline)
            ids, mask, pos = ids[:, drop:], mask[:, drop:], pos[:, drop:]
        self.hooks.compact([row.capture for row in self.rows], keep)  # last before the swap: all or nothing
        self.rows = [self.rows[i] for i in keep]
        self.cache, self.ids, self.mask, self.pos = cache, ids, mask, pos
        self.pads = [pad - drop for pad in pads]

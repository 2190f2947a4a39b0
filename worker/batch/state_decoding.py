"""Batched decoding for recurrent and hybrid models (Mamba, Mamba-2, Jamba, GraniteMoeHybrid,
Qwen3-Next, LFM2, RecurrentGemma): each running sequence's recurrent state in a slot of
worker/model/state_slots.py, every decoding step one forward pass over all of them.

A sequence joins as on the solo decoder (worker/batch/solo.py): its prompt runs alone through the
model's own cache, built and carried as `generate` does it, and picks its first token; that
cache's state (and what the model keeps on its modules, snapshotted right after the pass) is
then copied into a free slot and the sequence becomes the last row of the running batch. A
decoding step feeds every row's newest token in one pass over a cache gathered from the rows'
slots (`StateSlots.batch`), and the state the pass left is written back into those slots
(`StateSlots.keep`). A row that ends leaves the batch and frees its slot; no other slot
moves. A state-space layer's decode path mixes nothing across rows, so each row computes what it
computes alone (tested against its solo run and against forward hooks on `generate`).

Everything per row is the batch's (worker/batch/batch_passes.py, worker/batch/row_rules.py): the sampler,
grammars, stop strings, EOS and max_tokens, the watch, log-probabilities, the capture
hooks (`BatchHooks`: rows that join become more targets of the staging rings; rows that leave
take their staged steps, `drain` then `compact`) and the edits. Out of memory in a step,
worker/batch/oom.py's policy: the rows run in halves, down to one row that fails alone (its slot
keeps nothing of the failed pass: state is written back only after a pass that succeeded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from worker.batch.oom import in_halves, lowered_cap, stitched
from worker.batch.sequence import Sequence, Undo
from worker.batch.solo import SoloDecoder
from worker.hooks.paths import PassRows
from worker.model.slots import causal_mask
from worker.model.state_slots import ModuleStates, StateSlots
from worker.rules.failures import is_oom, out_of_memory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class StateDecoder(SoloDecoder):
    """The running batch of a recurrent or hybrid model: `rows` in batch order, `slot_of[b]` the
    state slot of row b. The interface of every running batch for the engine core
    (worker/batch/running_batch.py): `admit_many`, `step`, `trace`, `feed`, `rows`, `most_rows`, `reset`,
    `close`, `hooks`. Not thread-safe: one thread drives it."""

    def __init__(self, model: Any, tokenizer: PreTrainedTokenizerBase, pad_id: int, slots: int = 16) -> None:
        super().__init__(model, tokenizer, pad_id)
        self.most_rows = None  # as many rows as the scheduler hands out (lowered after running out of memory)
        self.first_slots = max(1, slots)
        self.slots: StateSlots | None = None  # made at the first join, shaped as its prefill's cache
        self.slot_of: list[int] = []
        self._cache_key: str | None = None  # the model's name for its cache argument
        self.module_states = ModuleStates(model)  # state the model keeps on its modules (RecurrentGemma's)

    # -- joining ---------------------------------------------------------------------------

    def admit_many(self, seqs: list[Sequence]) -> None:
        """Run each prompt alone (as `generate` runs it) and pick its first token; those not ended
        by it join the running batch, each in a free slot. All or nothing: on failure the batch is
        as it was and each sequence as before the call."""
        saved = [Undo.of(seq) for seq in seqs]
        joining: list[tuple[Sequence, DynamicCache, list[torch.Tensor]]] = []
        try:
            for seq in seqs:
                cache = self._prefill_alone(seq)
                if cache is not None:  # the modules' state is this sequence's until the next pass
                    joining.append((seq, cache, self.module_states.snapshot()))
            if joining and self.slots is None:
                tokens = max(seq.prompt_tokens + seq.max_tokens for seq, _, _ in joining)
                _, cache, held = joining[0]
                self.slots = StateSlots(self.model.config, cache, self.first_slots, tokens, self.module_states, held)
            taken: list[int] = []
            try:
                for seq, cache, held in joining:
                    assert self.slots is not None
                    slot = self.slots.take(seq.prompt_tokens + seq.max_tokens)
                    taken.append(slot)
                    self.slots.write(slot, cache, held)
            except BaseException:
                for slot in taken:
                    self.slots.release(slot)  # type: ignore[union-attr]  # made above
                raise
        except BaseException:
            for undo in saved:
                undo.apply()
            raise
        self.rows = self.rows + [seq for seq, _, _ in joining]
        self.slot_of = self.slot_of + taken

    def _prefill_alone(self, seq: Sequence) -> DynamicCache | None:
        """The prompt's pass with a fresh cache of the model's own (`SoloDecoder._start`), then its
        first token: the filled cache, or None when that token ended the sequence."""
        state = self._start(seq)
        ids = seq.prompt_ids
        inputs = self.model.prepare_inputs_for_generation(
            ids, next_sequence_length=ids.shape[1], is_first_iteration=True, **state
        )
        logits, state = self._pass(seq, inputs, state, decoding=False)
        self._advance([seq], logits, lambda _: seq.prompt_ids)
        if seq.ended is not None:
            return None
        key = next(name for name, value in state.items() if isinstance(value, DynamicCache))
        self._cache_key = key
        return state[key]

    # -- one decoding step -----------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Feed every row's newest token in one pass; returns the rows that ended (out of the batch,
        their slots free)."""
        if not self.rows:
            return []
        rows = self.rows
        self.hooks.settle([row.capture for row in rows])  # staged steps of another batch, before the marks
        logits = self._run(rows, list(self.slot_of))
        if logits is not None:
            self._advance(rows, logits, lambda i: rows[i].all_ids())
        ending = {i for i, row in enumerate(rows) if row.ended is not None}
        if not ending:
            return []
        self.hooks.drain(ending, [row.capture for row in rows])  # the ending rows take their staged steps
        for row in rows:
            if row.failure is None and row.capture is not None and row.capture.failure is not None:
                row.failure = row.capture.failure
                row.ended = row.ended if row.ended is not None else "failed"
        return self._leave()

    def _leave(self) -> list[Sequence]:
        """The rows that ended, out of the batch; their slots free."""
        rows = self.rows
        keep = [i for i, row in enumerate(rows) if row.ended is None]
        ended = [row for row in rows if row.ended is not None]
        self.hooks.compact([row.capture for row in rows], keep)
        assert self.slots is not None
        for i, row in enumerate(rows):
            if row.ended is not None:
                self.slots.release(self.slot_of[i])
        self.rows = [rows[i] for i in keep]
        self.slot_of = [self.slot_of[i] for i in keep]
        return ended

    def _run(self, rows: list[Sequence], slots: list[int]) -> torch.Tensor | None:
        """One decoding pass over `rows` (their state in `slots`): their logits `[B, V]`, or None
        when every row failed. Out of memory, worker/batch/oom.py's policy: the failed pass's
        captures are put back (its state was never kept) and the rows run in halves, down to one
        row that fails alone (its logits row is zeros, unread); batches are capped at the half."""
        marks = [row.capture.mark() if row.capture else None for row in rows]

        def run(lo: int, hi: int) -> tuple[torch.Tensor | None, int]:
            return self._forward_slots(rows[lo:hi], slots[lo:hi]), hi - lo

        def undo(lo: int, hi: int) -> None:
            for row, mark in zip(rows[lo:hi], marks[lo:hi], strict=True):
                if row.capture is not None and mark is not None:
                    row.capture.reset(mark)

        def fail(lo: int, hi: int, exc: Exception) -> tuple[torch.Tensor | None, int]:
            if not is_oom(exc):
                raise exc
            for row in rows[lo:hi]:
                row.failure, row.ended = out_of_memory(), "failed"
            return None, hi - lo

        def split(size: int) -> None:
            self.most_rows = lowered_cap(self.most_rows, size, "batch")

        return stitched(in_halves(0, len(rows), run, fail, undo, split))

    def _forward_slots(self, rows: list[Sequence], slots: list[int]) -> torch.Tensor:
        """One pass feeding each row's newest token over the state of its slot; the state it
        leaves goes back into the slots once the pass succeeded."""
        assert self.slots is not None and self._cache_key is not None
        device = rows[0].prompt_ids.device
        ids = torch.tensor([[row.generated[-1]] for row in rows], dtype=torch.long, device=device)
        at = [row.prompt_tokens + len(row.generated) - 1 for row in rows]  # the position each row feeds
        positions = torch.tensor(at, dtype=torch.long, device=device)
        cache = self.slots.batch(slots, positions, max(at) + 1)
        inputs: dict[str, Any] = {"input_ids": ids, self._cache_key: cache, "use_cache": True}
        if self.logits_to_keep:
            inputs["logits_to_keep"] = 1
        if self._takes_positions:
            inputs["position_ids"] = positions.unsqueeze(1)
        if self._takes_mask and self.slots.attends:  # each row sees its own positions of its slot, no further
            mask = causal_mask(positions, max(at) + 1, self.model.dtype)
            window = self.slots.window
            if window is not None:  # and a local attention layer only its last `window` (RecurrentGemma's)
                local = causal_mask(positions, max(at) + 1, self.model.dtype, window)
                inputs["attention_mask"] = {"full_attention": mask, "sliding_attention": local}
            else:
                inputs["attention_mask"] = mask
        step = PassRows.step(at)
        self.hooks.begin([row.capture for row in rows], step)
        self.edits.begin([row.edits for row in rows], step)
        with self.edits.record(step), self.hooks.record(step):
            out = self.model(**inputs, return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        del out
        self.slots.keep(slots, cache)
        failures = self.hooks.finish()  # last: this pass's staged rows count once the pass cannot fail any more
        self.edits.finish()
        for index, failure in failures.items():
            rows[index].failure = failure
        return logits

    # -- the rest of the interface ---------------------------------------------------------

    def reset(self) -> None:
        """Drop the running batch: every slot free (their tensors stay allocated)."""
        super(SoloDecoder, self).reset()  # the batch's own reset, not the solo decoder's
        self.state, self.pads = {}, [0]
        self.slot_of = []
        if self.slots is not None:
            self.slots.release_all()

    def trace(self, seqs: list[Sequence]) -> None:
        """The batch's trace (one forward pass, no cache): the state lives in the slots, so a trace
        may run beside a running batch (what it leaves on a model's modules, RecurrentGemma's, is
        set from the slots again before the next step)."""
        super(SoloDecoder, self).trace(seqs)  # the batch's own trace, without the solo decoder's refusal

    def cache_size(self) -> tuple[int, int, int]:
        """The state held between steps: (bytes, slots, 1: a slot's state does not grow)."""
        if self.slots is None:
            return (0, 0, 0)
        return (self.slots.nbytes, self.slots.slots, 1)

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
grammars, stop strings, EOS and max_tokens, the watch, log-probabilities. A decoding step captures
and edits as the slots' decoder does, with table operations by slot (the device rings of
worker/hooks/step_capture.py, handed to the capture writer; the per-slot edit tables of
worker/hooks/step_edits.py, which read each slot's position from `fed`); a prompt's pass and a
trace take the hooks (worker/hooks/paths.py says why). Out of memory in a step,
worker/batch/oom.py's policy: the rows run in halves, down to one row that fails alone (its slot
keeps nothing of the failed pass: state is written back only after a pass that succeeded).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from worker.batch.oom import in_halves, lowered_cap, stitched
from worker.batch.sequence import Sequence, Undo
from worker.batch.solo import SoloDecoder
from worker.hooks.paths import PassRows
from worker.hooks.step_capture import StepRings
from worker.hooks.step_edits import EditPlan, StepEdits, fits
from worker.model.slots import causal_mask
from worker.model.state_slots import ModuleStates, StateSlots
from worker.rules.failures import failure_of, is_oom, out_of_memory

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
        # The step tables, by slot (made with the slots): captures in device rings, edits in
        # per-slot tables (worker/hooks/step_capture.py, step_edits.py), as the slots' decoder does
        self.rings: StepRings | None = None
        self.tables: StepEdits | None = None
        self.fed: torch.Tensor | None = None  # [slots, 1]: the position each slot feeds (the tables read it)

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
        if self.slots is not None:
            self._fit_tables(self.slots, self.rows[0].prompt_ids.device if self.rows else None)

    def _fit_tables(self, slots: StateSlots, device: torch.device | None) -> None:
        """The step tables as wide as the slots (made at the first join; more slots: the rings'
        recorded steps handed over first) and their flags as long."""
        if device is None:
            return
        if self.rings is None or self.tables is None or self.fed is None:
            self.fed = torch.zeros((slots.slots, 1), dtype=torch.long, device=device)
            self.rings = StepRings(self.model, slots.slots, device)
            self.tables = StepEdits(self.model, self.fed, 0, slots.tokens)
        elif slots.slots > self.rings.slots:
            self.rings.hand_over()
            self.rings.resized(slots.slots)
            fed = self.fed.new_zeros((slots.slots, 1))
            fed[: self.fed.shape[0]] = self.fed
            self.fed = fed
            self.tables.resized(fed)
        self.tables.grown(slots.tokens)

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
        their slots free). Captures and edits are table operations on the step, by slot (see
        worker/hooks/paths.py); a row's edits the tables cannot hold (`fits`) put the step's edits
        on the hooks (worker/hooks/edits.py)."""
        if not self.rows:
            return []
        rows, rings, tables = self.rows, self.rings, self.tables
        assert rings is not None and tables is not None
        slot_of = list(self.slot_of)
        captures = self._by_slot([row.capture for row in rows], rings.slots)
        keys = rings.keys(captures)
        self.hooks.release()  # a prefill's or a trace's hooks: never inside a decoding step
        if keys and not rings.ready(keys):
            rings.hand_over(rewind=True)  # a ring to make: from ring step 0
        elif keys and rings.due:
            rings.hand_over()  # half the ring written: to the writer while the other half fills
        if keys:
            rings.before_step()
        plan: EditPlan | None = None
        if all(row.edits is None or fits(row.edits) for row in rows):
            self.edits.use([], [], 1)  # an earlier pass's edit hooks: not in the step
            tables.sync(self._by_slot([row.edits for row in rows], tables.slots))
            plan = tables.plan(tables.slots)
        logits = self._run(rows, slot_of, keys, plan)
        if keys:
            rings.advance()
            rings.stepped(captures)
        if logits is not None:
            self._advance(rows, logits, lambda i: rows[i].all_ids())
        if any(row.ended is not None for row in rows):
            return self._leave()
        return []

    def _by_slot(self, values: list, slots: int) -> list:
        """Each running row's value at its slot's place (None at a free slot)."""
        out = [None] * slots
        for slot, value in zip(self.slot_of, values, strict=True):
            out[slot] = value
        return out

    def _leave(self) -> list[Sequence]:
        """The rows that ended, out of the batch: their captured steps handed over (their results
        wait for them), their gated edits' flags read, their slots free."""
        rows, rings, tables = self.rows, self.rings, self.tables
        assert self.slots is not None and rings is not None and tables is not None
        ending = [i for i, row in enumerate(rows) if row.ended is not None]
        if any(rows[i].capture is not None for i in ending):
            rings.hand_over()  # a leaving row's last steps
        for i in ending:
            row, slot = rows[i], self.slot_of[i]
            if row.failure is None and row.capture is not None and row.capture.failure is not None:
                row.failure, row.ended = row.capture.failure, "failed"
            if row.failure is None and row.edits is not None and any(e.gate is not None for e in row.edits.edits):
                try:  # where its gates fired at its steps (their report): read once, as it leaves
                    tables.collect(slot, row.edits, row.prompt_tokens, len(row.generated))
                except Exception as exc:  # noqa: BLE001 - that row's failure, never the batch's
                    row.failure, row.ended = failure_of(exc), "failed"
            self.slots.release(slot)
        keep = [i for i, row in enumerate(rows) if row.ended is None]
        self.rows = [rows[i] for i in keep]
        self.slot_of = [self.slot_of[i] for i in keep]
        return [rows[i] for i in ending]

    def _run(
        self, rows: list[Sequence], slots: list[int], keys: frozenset, plan: EditPlan | None
    ) -> torch.Tensor | None:
        """One decoding pass over `rows` (their state in `slots`): their logits `[B, V]`, or None
        when every row failed. Out of memory, worker/batch/oom.py's policy: the rows run in halves,
        down to one row that fails alone (its logits row is zeros, unread; its slot keeps nothing
        of the failed pass, whose state is never kept; the halves write the rings' rows again);
        batches are capped at the half."""

        def run(lo: int, hi: int) -> tuple[torch.Tensor | None, int]:
            return self._forward_slots(rows[lo:hi], slots[lo:hi], keys, plan), hi - lo

        def fail(lo: int, hi: int, exc: Exception) -> tuple[torch.Tensor | None, int]:
            if not is_oom(exc):
                raise exc
            for row in rows[lo:hi]:
                row.failure, row.ended = out_of_memory(), "failed"
            return None, hi - lo

        def split(size: int) -> None:
            self.most_rows = lowered_cap(self.most_rows, size, "batch")

        return stitched(in_halves(0, len(rows), run, fail, split=split))

    def _forward_slots(
        self, rows: list[Sequence], slots: list[int], keys: frozenset, plan: EditPlan | None
    ) -> torch.Tensor:
        """One pass feeding each row's newest token over the state of its slot, capturing into the
        rings and editing from the tables (or the hooks, `plan` None); the state it leaves goes
        back into the slots once the pass succeeded."""
        assert self.slots is not None and self._cache_key is not None
        assert self.rings is not None and self.tables is not None and self.fed is not None
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
        if plan is None:  # a row's edits the tables cannot hold: the hooks edit this step
            step = PassRows.step(at)
            self.edits.begin([row.edits for row in rows], step)
            edits: AbstractContextManager[object] = self.edits.record(step)
        else:
            self.fed[slots, 0] = positions  # what the tables' ops select by
            edits = self.tables.recording(plan, 0, len(rows), slots)
        with edits, self.rings.recording(keys, 0, len(rows), slots):
            out = self.model(**inputs, return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        del out
        self.slots.keep(slots, cache)
        if plan is None:
            self.edits.finish()  # last: this pass's gates count once the pass cannot fail any more
        return logits

    # -- the rest of the interface ---------------------------------------------------------

    def reset(self) -> None:
        """Drop the running batch: every slot free (their tensors stay allocated)."""
        super(SoloDecoder, self).reset()  # the batch's own reset, not the solo decoder's
        self.state, self.pads = {}, [0]
        self.slot_of = []
        if self.rings is not None:
            self.rings.discard()
        if self.slots is not None:
            self.slots.release_all()

    def close(self) -> None:
        """Every hook off the model, the rings' too."""
        super().close()
        if self.rings is not None:
            self.rings.close()

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

"""The running batch in slots: every batch's prefills, trace passes and chunked prompts
(worker/batch/batch_passes.py), with the
decoding steps of worker/model/runner.py over a persistent batch (worker/model/input_batch.py) and a
KV cache in slots (worker/model/slots.py).

A prefilled sequence takes the lowest free slot, its prompt's keys and values are copied there, and
it decodes in it until it ends; then its slot is free. No step moves, compacts or concatenates
anything. The cache's size follows the rows (worker/model/slot_sizing.py,
worker/batch/slot_resizing.py): grown when a sequence that needs more joins, shrunk between two
steps once the long rows have left, every running row's keys and values copied over exactly. Every
row's token comes from the vectorised sampler (worker/model/sampling.py), its first one (chosen by
its prefill) too, with the row's own settings and seed.

A step runs as its bucket's CUDA graph when the model is on a GPU. A row's captures are
recorded inside the step, graph or not (worker/hooks/step_capture.py: device rings, handed over to the
capture writer thread every half ring, when a capturing row leaves and before the slots are
resized: the loop never waits for the jobs' rows), and so are its
edits (worker/hooks/step_edits.py: per-slot tables, gated edits included). A batch with a patch runs
its steps eagerly with the hooks of worker/hooks/edits.py over the slots [0, rows) (a free slot is a row
that edits nothing). Out of memory in an eager step, the slots run in halves (what
the failed pass wrote is written again: each row writes only its own position), down to one
row, which then fails alone; later batches stay at the half.

Overlap: with graphs, a step is launched before the tokens of the step before it are read (the
state it feeds is committed inside the step, on the device), so the device runs it while the host
checks the last step's rows; a row found ended rode one step more, whose token and captured row
are dropped; where rows have grammars, only the next step's model pass goes ahead, and its sampler
follows once the masks are filled from the tokens read (`_ahead`). Log-probabilities are computed
on the device as a step is launched (worker/batch/step_scores.py), so they never hold the next step back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from worker.batch.batch_passes import BatchPasses
from worker.batch.oom import in_halves, lowered_cap
from worker.batch.sequence import Sequence
from worker.batch.slot_resizing import SlotResizing
from worker.batch.step_scores import Scored, score_step, take_scores
from worker.hooks.step_edits import EditPlan, fits
from worker.model.input_batch import InputBatch, Reading
from worker.model.runner import DecodeStep
from worker.model.sampling import Features
from worker.model.slot_sizing import CacheLimits, Shape, SlotSizing
from worker.rules.constrained import fill_bitmask
from worker.rules.failures import failure_of

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """A decoding step launched: who each slot was (None: free) and its tokens on their way to
    the host (None: only its model pass is launched; `shape` is the slots and positions its
    sampler then runs over)."""

    owners: list[Sequence | None]
    reading: Reading | None
    shape: tuple[int, int] = (0, 0)
    tabled: bool = True
    scored: Scored | None = None  # its log-probabilities, for the rows that asked


class SlotDecoder(SlotResizing, BatchPasses):
    """The running batch of up to `slots` sequences in slots (see the module). Not thread-safe:
    one thread drives it (the engine core)."""

    # Launch the step after before reading a step's tokens (see `step`). None: when the steps
    # replay as CUDA graphs (a replay returns at once; an eager step on the CPU computes as it is
    # launched, so there is nothing to overlap); tests turn it on to check it.
    overlap: bool | None = None

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        pad_id: int,
        slots: int,
        max_tokens: int,
        graphs: bool = False,
        limits: CacheLimits | None = None,
        position_bytes: int = 0,
    ) -> None:
        super().__init__(model, tokenizer, pad_id)
        self.slots = slots
        self.max_tokens = max_tokens  # the model's context: no slot grows past it (0: no limit)
        self.graphs = graphs
        # The KV cache's shape (worker/model/slot_sizing.py); `position_bytes`: a slot position's bytes
        # before the cache exists (the model's published figure; 0: unknown), exact after.
        self.sizing = SlotSizing(slots, max_tokens, limits)
        self.position_bytes = position_bytes
        self._resizable = False  # rows joined or left since the shrink check last looked
        self._smaller: Shape | None = None  # a smaller shape the running rows fit, and since when
        self._smaller_since = 0.0
        self._launched: Launched | None = None
        self.batch: InputBatch | None = None
        self.runner: DecodeStep | None = None

    # -- joining ---------------------------------------------------------------------------

    def _admit_many(self, seqs: list[Sequence]) -> None:
        cache, _, _, _, pads = self._prompt_pass(seqs)
        going = [i for i, seq in enumerate(seqs) if not seq.ended]
        if going:
            self._take_slots([(seqs[i], i, pads[i]) for i in going], cache)

    def _join(self, joining: list[Sequence], cache: Any, ids, mask, pos, pads: list[int]) -> None:
        """A chunked prompt, all fed (`BatchPasses.feed`): into a slot."""
        self._take_slots([(seq, i, pads[i]) for i, seq in enumerate(joining)], cache)

    def _take_slots(self, joining: list[tuple[Sequence, int, int]], prefilled: Any) -> None:
        """Each (sequence, its row in `prefilled`, its padding there) into a free slot, its prompt's
        keys and values copied in. All or nothing: on failure no slot was taken."""
        self._ensure(prefilled, [seq for seq, _, _ in joining])
        assert self.batch is not None and self.runner is not None
        taken: list[int] = []
        try:
            for seq, row, pad in joining:
                settings = self._settings(seq)
                generated = torch.tensor(seq.generated, dtype=torch.int64, device=seq.prompt_ids.device)
                tokens = torch.cat([seq.prompt_ids[0], generated])
                slot = self.batch.join(seq, tokens, seq.prompt_tokens, settings)
                taken.append(slot)
                self.runner.cache.write(slot, prefilled, row, pad, seq.prompt_tokens)
        except BaseException:
            for slot in taken:
                self.batch.leave(slot)
            raise
        self.rows += [seq for seq, _, _ in joining]
        self._resizable = True

    # -- one decoding step -----------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Every running row's next token; returns the rows that ended (their slots freed).

        With `overlap`, the step after is launched before this one's tokens are read, whenever it
        does not depend on them (see `_ahead`): the device runs it while the host checks this
        step's rows; a row found ended then rode one step more, whose token and captured row are
        dropped. A batch with a grammar launches only the model pass of the step after; its
        sampler follows once this step's tokens have moved the grammars on and the masks are
        filled (the CPU fills them while the device runs the model). The rows a call returns are
        those of the step it read."""
        if not self.rows:
            self._launched = None
            return []
        self._shrink()
        try:
            current = self._launched or self._launch()
            self._launched = None
            how = self._ahead(current)
            ahead = self._launch(forward_only=how == "forward") if how is not None else None
            assert current.reading is not None
            tokens = current.reading.tokens()
        except Exception as exc:  # noqa: BLE001 - rows that ended keep their results; the others cannot go on
            return self._fail_all(exc)
        ended = self._read(current, tokens, ahead)
        if ahead is not None and ahead.reading is None and self.rows:
            try:
                self._sample(ahead)
            except Exception as exc:  # noqa: BLE001 - as a failed step
                return ended + self._fail_all(exc)
        self._launched = ahead if self.rows else None
        return ended

    def _fail_all(self, exc: Exception) -> list[Sequence]:
        """A step failed as a whole: every running row fails with it and the batch is dropped."""
        failure = failure_of(exc)
        for row in self.rows:
            if row.ended is None:
                row.failure, row.ended = failure, "failed"
        failed = list(self.rows)
        self.reset()
        return failed

    def _ahead(self, current: Launched) -> str | None:
        """What of the step after `current` can be launched before `current`'s tokens are read,
        with `overlap` on: the whole step ("step"); its model pass only ("forward"), when a row
        has a grammar (its mask comes from the token being read); or nothing (None), when a row
        has edits the tables cannot hold (the hooks' spans count the tokens taken), or when no row
        goes on after `current` (the step would be wasted whole)."""
        overlap = self.overlap if self.overlap is not None else self.runner is not None and self.runner.graphs
        if not overlap or self.batch is None:
            return None
        rows = [o for o in self.batch.owners if isinstance(o, Sequence)]  # with any that joined since
        grammar = False
        for row in rows:
            if row.edits is not None and not fits(row.edits):
                return None
            grammar = grammar or row.constraint is not None
        stepped = {id(row) for row in current.owners if row is not None}
        if not any(r.ended is None and (id(r) not in stepped or len(r.generated) + 1 < r.max_tokens) for r in rows):
            return None
        return "forward" if grammar else "step"

    def _launch(self, forward_only: bool = False) -> Launched:
        """One decoding step of every slot in use, launched: the staged joins and leaves, the
        rows' masks and edit tables, the step (its graph, or eagerly) and the copy of its tokens
        to the host started; with `forward_only`, its model pass alone (`_sample` launches the
        rest). Nothing waits for the device."""
        batch, runner = self.batch, self.runner
        assert batch is not None and runner is not None
        n = batch.span_rows
        owners: list[Sequence | None] = [o if isinstance(o, Sequence) else None for o in batch.owners[:n]]
        captures = [s.capture if s is not None else None for s in owners]
        keys = runner.rings.keys(captures)
        constrained = False if forward_only else self._masks(owners)
        row_edits = [s.edits if s is not None else None for s in owners]
        tabled = all(e is None or fits(e) for e in row_edits)  # else worker/hooks/edits.py's hooks, eagerly
        eager = not runner.graphs or not tabled
        self.hooks.release()  # a prefill's hooks: never inside a decoding step (nor its graph)
        if keys and not runner.rings.ready(keys):
            runner.rings.hand_over(rewind=True)  # a ring to make: from ring step 0
        elif keys and runner.rings.due:
            runner.rings.hand_over()  # half the ring written: to the writer while the other half fills
        if keys:
            runner.rings.before_step()
        plan: EditPlan | None = None
        if tabled:
            self.edits.use([], [], 1)  # an earlier pass's edit hooks: not in the step (nor its graph)
            runner.edits.sync(row_edits)
            plan = runner.edits.plan(n)
        batch.flush()
        features = batch.sampling.features(slice(0, n))
        stage = "forward" if forward_only else "step"
        span = batch.span_positions()
        shape = (n, span)
        if eager:
            self._eager(0, n, owners, constrained, features, keys, plan, top=True, stage=stage, span=span)
            if keys:
                runner.rings.advance()
        elif forward_only:
            assert plan is not None
            shape = runner.replay_forward(keys, plan)
        else:
            assert plan is not None
            runner.replay(constrained, features, keys, plan)
        if keys:
            runner.rings.stepped(captures)
        if forward_only:
            return Launched(owners, None, shape, tabled)
        batch.advanced()
        scored = score_step(batch.logits, batch.next, owners)
        return Launched(owners, batch.copy_next(n), shape, tabled, scored)

    def _sample(self, launched: Launched) -> None:
        """The sampler of a step whose model pass alone was launched (`_launch(forward_only=True)`),
        with the masks of its rows' grammars as they now stand; then its tokens' copy to the host."""
        batch, runner = self.batch, self.runner
        assert batch is not None and runner is not None
        owners = launched.owners  # rows that ended since are None: their token is no one's
        rows, span = launched.shape
        constrained = self._masks(owners)
        features = batch.sampling.features(slice(0, rows))
        if not runner.graphs or not launched.tabled:
            self._eager(0, rows, owners, constrained, features, frozenset(), None, top=True, stage="sample", span=span)
        else:
            runner.replay_sample(rows, span, constrained, features)
        batch.advanced()
        launched.scored = score_step(batch.logits, batch.next, owners)
        launched.reading = batch.copy_next(len(owners))

    def _read(self, current: Launched, tokens: list[int], ahead: Launched | None) -> list[Sequence]:
        """`current`'s tokens taken by its rows; the rows that ended leave (their captured rows
        handed over, without the step `ahead` ran for them)."""
        assert self.batch is not None and self.runner is not None
        owners = current.owners
        self._after(owners, tokens, current.scored)
        ending = {slot for slot, s in enumerate(owners) if s is not None and s.ended is not None}
        if not ending:
            return []
        rings = self.runner.rings
        if any(owners[slot].capture is not None for slot in ending):  # type: ignore[union-attr]
            if ahead is not None:
                for slot in ending:
                    rings.ended(slot, 1 if slot < len(ahead.owners) and ahead.owners[slot] is owners[slot] else 0)
            rings.hand_over()  # a leaving row's last steps (its result waits for them)
        ended: list[Sequence] = []
        for slot in sorted(ending):
            leaving = owners[slot]
            assert leaving is not None
            if leaving.failure is None and leaving.capture is not None and leaving.capture.failure is not None:
                leaving.failure, leaving.ended = leaving.capture.failure, "failed"
            if ahead is not None and slot < len(ahead.owners):
                ahead.owners[slot] = None  # its token from the step ahead is no one's
            if (
                leaving.failure is None
                and leaving.edits is not None
                and any(e.gate is not None for e in leaving.edits.edits)
            ):
                try:  # where its gates fired at its steps (their report): read once, as it leaves
                    self.runner.edits.collect(slot, leaving.edits, leaving.prompt_tokens, len(leaving.generated))
                except Exception as exc:  # noqa: BLE001 - that row's failure, never the batch's
                    leaving.failure, leaving.ended = failure_of(exc), "failed"
            self.batch.leave(slot)
            ended.append(leaving)
        self.rows = [row for row in self.rows if row.ended is None]
        self._resizable = True
        return ended

    def _masks(self, owners: list[Sequence | None]) -> bool:
        """The grammar masks of the rows with a constraint, into the batch's bitmask (one fill,
        one copy); False when no row has one. A fill that fails fails the rows it served."""
        assert self.batch is not None
        constrained = [slot for slot, s in enumerate(owners) if s is not None and s.constraint is not None]
        if not constrained:
            return False
        try:
            bits = fill_bitmask([owners[slot].constraint for slot in constrained])  # type: ignore[union-attr,misc]
        except Exception as exc:  # noqa: BLE001 - the mask failed: the rows it served fail
            failure = failure_of(exc)
            for slot in constrained:
                row = owners[slot]
                assert row is not None
                row.failure, row.ended = failure, "failed"
            bits = None
        masks = {slot: bits[i] for i, slot in enumerate(constrained)} if bits is not None else {}
        self.batch.set_masks(len(owners), masks)
        return True

    def _eager(
        self,
        lo: int,
        hi: int,
        owners: list[Sequence | None],
        constrained: bool,
        features: Features,
        keys: frozenset,
        plan: EditPlan | None,
        top: bool,
        stage: str = "step",
        span: int | None = None,
    ) -> None:
        """The step of slots [lo, hi) (or its `stage`: "forward", the model pass; "sample", the
        sampler over `span` positions): captures to the rings (`keys`), edits from the tables
        (`plan`) or, when a row's edits do not fit them (None), with worker/hooks/edits.py's hooks;
        out of memory, worker/batch/oom.py's policy: in halves (see the module)."""
        assert self.batch is not None
        span = self.batch.span_positions() if span is None else span

        def run(lo: int, hi: int) -> None:
            self._eager_part(lo, hi, owners, constrained, features, keys, plan, stage, span)

        def fail(lo: int, hi: int, exc: Exception) -> None:
            row = owners[lo]
            if row is not None and row.ended is None:
                row.failure, row.ended = failure_of(exc), "failed"

        def split(size: int) -> None:
            self.most_rows = lowered_cap(self.most_rows, size, "step")

        in_halves(lo, hi, run, fail, split=split if top else None)

    def _eager_part(
        self,
        lo: int,
        hi: int,
        owners: list[Sequence | None],
        constrained: bool,
        features: Features,
        keys: frozenset,
        plan: EditPlan | None,
        stage: str,
        span: int,
    ) -> None:
        """`_eager`'s one run of slots [lo, hi), without the policy."""
        assert self.batch is not None and self.runner is not None
        part = owners[lo:hi]
        if plan is None and stage != "sample":
            spans = [(s.prompt_tokens + len(s.generated) - 1, 1) if s is not None else (0, 1) for s in part]
            self.edits.use([s.edits if s is not None else None for s in part], spans, 1)
        full = all(s is not None and self.batch.host_positions[lo + i] + 1 == span for i, s in enumerate(part))
        if stage == "sample":
            self.runner.sample(lo, hi, span, constrained, features)
        else:
            tables = self.runner.edits.recording(plan or frozenset(), lo, hi - lo)
            with tables, self.runner.rings.recording(keys, lo, hi - lo):
                if stage == "forward":
                    self.runner.forward(lo, hi, span, full)
                else:
                    self.runner.decode(lo, hi, span, constrained, full, features)
        self.edits.flush()

    def _after(self, owners: list[Sequence | None], tokens: list[int], scored: Scored | None) -> None:
        """Each running row's log-probabilities (`scored`, computed when its step was launched)
        and its token taken: whether it ended. A failure in one row's own work fails that row."""
        assert self.batch is not None
        self.rules.settle(owners)
        take_scores(scored, owners, tokens)
        self.rules.take_all(owners, tokens)

    def close(self) -> None:
        """Hooks removed, and the slots and tables let go (a frame kept alive by a logged
        traceback may still reference this decoder: it then holds no memory worth keeping)."""
        super().close()
        self._launched = None
        if self.runner is not None:
            self.runner.rings.close()
        self.batch = self.runner = self._table = None
        self.rows = []

    def reset(self) -> None:
        """Drop the running batch (after a step failed: its rows were answered with the failure)."""
        self.hooks.discard()
        self._launched = None
        if self.runner is not None:
            self.runner.rings.discard()
        if self.batch is not None:
            for slot, owner in enumerate(self.batch.owners):
                if owner is not None:
                    self.batch.leave(slot)
        self.rows = []
        self._resizable = True

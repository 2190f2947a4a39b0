"""The scheduler: which jobs join the running batch and what each turn of the engine runs. It
holds no tensor and runs no model (vLLM v1's split): each turn it hands the engine core
(worker/engine/core.py) one `StepPlan` (a unit of prefill work or none, then a decoding step when
rows decode), the core runs it on the running batch, and `update_from_output` reads back what it
took (`StepOutcome`).

Admission: queued jobs join while there is room, at most `max_batch` sequences and, together, at
most `budget_bytes` of estimated KV cache and capture buffers (a job alone always runs, whatever
its estimate), and while the batch's real KV cache can hold them beside the running rows (the
batch answers `must_wait`: the slots' cache is capped by ACTQ_KV_CACHE_MAX_BYTES, and its slots
are as long as its longest row, which the estimates do not count). A sequence leaves the batch
the step it ends and its place is free for the next job at the next step (iteration-level
scheduling). When nothing runs it waits for a job, then up to `wait_s` for more, so that a burst
of submissions starts together.

Prefill work: jobs taken in wait for their prefill. Generations of similar prompt lengths prefill
in one left-padded pass (`passes`), trace jobs run in passes of their own, and a text longer than
the decoder's chunk is fed a chunk at a time. Beside other work, a unit of prefill is at most
`chunk_tokens` positions (ACTQ_PREFILL_CHUNK_TOKENS: the token budget of a unit), and the units
take turns: a unit that served the work that arrived first is followed by one for the work with
the fewest positions left (a new short prompt, or the long text nearest its end), and that by one
for the oldest again. So a short job that
arrives while a long prompt is fed waits for at most one chunk, not the whole prompt, and the
oldest work still gets every second unit (nothing starves). A plan holds one unit, and each turn
takes in what arrived meanwhile before it is planned (worker/engine/core.py's `tick`).

Fair share: while jobs decode, prefill work gets at most about half of the engine's time: the time
a prefill pass or chunk took is owed to the running batch, which decodes until it has had as much;
so a long trace or a burst of prompts slows running jobs down about twofold at most, never freezes
them. A batch that starts empty is not yet decoding: a burst's passes (split by length or memory)
run one after another before its first step, so its rows start, and for equal lengths end,
together; fed between decoding steps, the burst's rows would start a few steps apart and every
later job would join alone, in a pass of its own, as each place frees.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.batch.sequence import Sequence

TRACE_PADDING = 0.1  # the most of a trace pass's positions that may be padding


@dataclass
class Entry:
    """A job handed to the engine: its prepared sequence; `done` gets the ended sequence or the
    failure and must not block (it hands the result to another thread); `started` is called when
    it joins a batch (its time limit counts from then); `estimate` is the bytes it holds while it
    runs (the memory budget)."""

    seq: Sequence
    done: Callable[[Any], None]
    estimate: int = 0
    started: Callable[[], None] = lambda: None
    joined: float = field(default_factory=time.monotonic)


class Batch(Protocol):
    """What the scheduler reads of the running batch (a decoder): its rows, its limits, and
    which sequences need logits at every prompt position (they prefill apart)."""

    rows: list[Any]
    most_rows: int | None
    chunk_tokens: int | None

    def wants_logits(self, seq: Any) -> bool: ...

    def must_wait(self, joining: list[Any]) -> bool: ...


@dataclass
class Feed:
    """Prefill work: the next chunk of `entry`'s long text."""

    entry: Entry


@dataclass
class Pass:
    """Prefill work: one pass over `entries` (trace jobs, or generations that then join)."""

    entries: list[Entry]
    trace: bool


@dataclass
class StepPlan:
    """One turn of the engine as the scheduler decides it, with no tensor (vLLM v1's
    `SchedulerOutput`): `prefill`, the unit of prefill work that runs first (None: none this
    turn), then, when `decode`, one decoding step of every row the running batch holds by then
    (those the unit joined included)."""

    prefill: Feed | Pass | None
    decode: bool


@dataclass
class StepOutcome:
    """What running a plan took, as the scheduler reads it back (`update_from_output`; vLLM v1's
    model runner output): the seconds of its prefill unit, and of its decoding step (None: none
    ran, the batch held no row after the unit)."""

    prefill_s: float = 0.0
    decode_s: float | None = None


class Scheduler:
    """Admission, the memory budget, prefill passes and the fair share (see the module).
    `cost(seq, padded_tokens)`: the bytes a sequence holds in a pass padded to that length."""

    def __init__(
        self,
        cost: Callable[[Any, int], int],
        max_batch: int,
        wait_s: float = 0.0,
        budget_bytes: int = 0,
        prefill_padding: float = TRACE_PADDING,
    ) -> None:
        self.cost, self.max_batch, self.wait_s, self.budget = cost, max_batch, wait_s, budget_bytes
        self.prefill_padding = prefill_padding  # the most of a pass's positions that may be padding
        self.inbox: queue.Queue[Entry | None] = queue.Queue()  # None: `wake`
        # Every job taken in and not yet answered: id(sequence) -> (entry, estimated bytes).
        self.active: dict[int, tuple[Entry, int]] = {}
        self._arrived: dict[int, int] = {}  # id(sequence) -> the order it was taken in
        self._counter = itertools.count()
        self.waiting: list[Entry] = []  # taken in, waiting for their prefill or trace pass
        self.feeding: list[Entry] = []  # long texts fed a chunk at a time, in order
        self.owed = 0.0  # seconds of decoding owed to the running batch for prefill work done
        self._fed: dict[int, int] = {}  # id(sequence) -> positions of its long text handed out so far
        self._oldest_turn = True  # the next unit of prefill: the oldest work's (else the shortest's)
        self._filling = False  # an empty batch is filling: its joining passes run before its first step

    def submit(self, entry: Entry) -> None:
        self.inbox.put(entry)

    def wake(self) -> None:
        """End a wait for jobs now (the engine has other work: worker/engine/core.py's `run_alone`)."""
        self.inbox.put(None)  # read and dropped by take_in

    # -- admission ---------------------------------------------------------------------------

    def room(self, batch: Batch) -> int:
        most = self.max_batch if batch.most_rows is None else min(self.max_batch, batch.most_rows)
        return most - len(batch.rows) - len(self.waiting) - len(self.feeding)

    def take_in(self, batch: Batch, wait: bool = True) -> None:
        """Take queued jobs in while there is room (jobs waiting for their prefill and long ones
        being fed count against `max_batch`); when nothing runs and `wait`, wait for one (then
        `wait_s` for company, so that a burst starts together)."""
        if wait and not batch.rows and not self.waiting and not self.feeding:
            try:
                first = self.inbox.get(timeout=0.5)  # wakes only to notice `stop`
            except queue.Empty:
                return
            if first is None:  # woken (`wake`)
                return
            self._consider(batch, first)
            deadline = time.monotonic() + self.wait_s
            while self.room(batch) > 0 and (left := deadline - time.monotonic()) > 0:
                try:
                    entry = self.inbox.get(timeout=left)
                except queue.Empty:
                    break
                if entry is None:
                    break
                if not self._consider(batch, entry):
                    break
        while self.room(batch) > 0:
            try:
                entry = self.inbox.get_nowait()
            except queue.Empty:
                break
            if entry is None:
                continue
            if not self._consider(batch, entry):
                break

    def _consider(self, batch: Batch, entry: Entry) -> bool:
        """Take `entry` in: a text longer than the batch's chunk is fed in chunks (`feeding`),
        any other waits in `waiting` for a prefill or trace pass. False when it must wait for
        room in the memory budget or the batch's KV cache (a job alone always runs)."""
        seq = entry.seq
        cost = self.cost(seq, seq.prompt_tokens) if seq.trace else entry.estimate
        used = sum(c for _, c in self.active.values())
        if self.active and self.budget and used + cost > self.budget:
            self._requeue(entry)
            return False
        if self.active and not seq.trace and batch.must_wait([e.seq for e in self.waiting + self.feeding] + [seq]):
            self._requeue(entry)
            return False
        self.active[id(seq)] = (entry, cost)
        self._arrived[id(seq)] = next(self._counter)
        if batch.chunk_tokens is not None and seq.prompt_tokens > batch.chunk_tokens:
            self.feeding.append(entry)
        else:
            self.waiting.append(entry)
        return True

    def _requeue(self, entry: Entry) -> None:
        """Over budget: back to the head of the line."""
        with self.inbox.mutex:
            self.inbox.queue.appendleft(entry)
            self.inbox.not_empty.notify()

    def answered(self, entry: Entry) -> None:
        """`entry` got its one answer: it no longer holds memory or a place."""
        self.active.pop(id(entry.seq), None)
        self._arrived.pop(id(entry.seq), None)
        self._fed.pop(id(entry.seq), None)

    def entry_of(self, seq: Any) -> Entry | None:
        """The entry of a running sequence (None: not one taken in here)."""
        found = self.active.get(id(seq))
        return found[0] if found is not None else None

    # -- the step plan -----------------------------------------------------------------------

    def schedule(self, batch: Batch) -> StepPlan:
        """This turn's plan: the next unit of prefill work, unless the running batch is owed time
        (`next_work`), then a decoding step when there are rows to decode: rows running now, or
        a pass or a long text's last chunk that joins rows (a trace joins none). A batch that was
        empty fills first: while more generations wait for their passes, a pass that joins rows
        is not followed by a step, so a burst split into passes starts decoding together."""
        self._filling = self._filling or not batch.rows
        work = self.next_work(batch)
        if isinstance(work, Pass):
            joins = not work.trace
            if joins and self._filling and any(not entry.seq.trace for entry in self.waiting):
                return StepPlan(prefill=work, decode=False)  # the burst's next pass first
        elif isinstance(work, Feed):
            joins = not work.entry.seq.trace and self._left(work.entry) <= 0  # its last chunk
        else:
            joins = False
        return StepPlan(prefill=work, decode=bool(batch.rows) or joins)

    def update_from_output(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """The fair share after a turn (see the module): the time its prefill unit took is owed to
        the running batch when rows decoded after it, and its decoding step paid that much back;
        a turn where no row decoded leaves nothing owed."""
        if outcome.decode_s is None:
            self.owed = 0.0
            return
        self._filling = False  # the batch decodes: joining it is planned by the fair share again
        if plan.prefill is not None:
            self.owed += max(outcome.prefill_s, 1e-9)
        self.owed = max(0.0, self.owed - outcome.decode_s)

    # -- prefill work ------------------------------------------------------------------------

    def next_work(self, batch: Batch) -> Feed | Pass | None:
        """The next unit of prefill work while the running batch is not owed time (None: decode):
        on the oldest's turn, the work that arrived first; on the other turn, the work with the
        fewest positions left (see the module). A unit is the pass of waiting jobs its job belongs
        to (taken out of `waiting`), or the next chunk of a long text (which stays in `feeding`
        until `fed`)."""
        if not (self.waiting or self.feeding) or (batch.rows and self.owed > 0):
            return None
        candidates: list[Entry] = [*self.feeding, *self.waiting]
        oldest = min(candidates, key=lambda e: self._arrived[id(e.seq)])
        if self._oldest_turn:
            pick = oldest
        else:
            pick = min(candidates, key=lambda e: (self._left(e), self._arrived[id(e.seq)]))
        self._oldest_turn = pick is not oldest  # the oldest served: the next unit is the shortest's
        if any(e is pick for e in self.feeding):
            self._fed[id(pick.seq)] = self._fed.get(id(pick.seq), 0) + (batch.chunk_tokens or pick.seq.prompt_tokens)
            return Feed(pick)
        kind = pick.seq.trace, batch.wants_logits(pick.seq)
        alike = [e for e in self.waiting if (e.seq.trace, batch.wants_logits(e.seq)) == kind]
        cap = batch.chunk_tokens if batch.rows or self.feeding else None  # beside other work: about a chunk's positions
        group = next(g for g in self.passes(alike, cap) if any(e is pick for e in g))
        self.waiting = [e for e in self.waiting if all(e is not g for g in group)]
        return Pass(group, trace=kind[0])

    def _left(self, entry: Entry) -> int:
        """Positions of `entry`'s prompt (or trace text) not yet handed out for prefill."""
        return entry.seq.prompt_tokens - self._fed.get(id(entry.seq), 0)

    def fed(self, entry: Entry) -> None:
        """`entry`'s long text is all fed, or failed: it is no longer being fed."""
        self.feeding = [e for e in self.feeding if e is not entry]
        self._fed.pop(id(entry.seq), None)

    def passes(self, entries: list[Entry], cap: int | None = None) -> list[list[Entry]]:
        """`entries` in passes of similar lengths: sorted, and a pass ends before padding would
        exceed `prefill_padding` (TRACE_PADDING) of its positions (padding is computed and thrown
        away: on a CPU, where a batch computes no faster per position, it is pure loss), its
        padded size the memory budget, or its padded positions `cap` (a job alone always runs)."""
        passes: list[list[Entry]] = []
        group: list[Entry] = []
        for entry in sorted(entries, key=lambda e: e.seq.prompt_tokens):
            padded = entry.seq.prompt_tokens  # sorted: the newest is the longest
            cost = sum(self.cost(e.seq, padded) for e in [*group, entry])
            positions = padded * (len(group) + 1)
            real = padded + sum(e.seq.prompt_tokens for e in group)
            if group and (
                positions - real > self.prefill_padding * positions
                or (self.budget and cost > self.budget)
                or (cap is not None and positions > cap)
            ):
                passes.append(group)
                group = []
            group.append(entry)
        if group:
            passes.append(group)
        return passes

"""The engine core: the one thread of the engine process that runs the model. It keeps one
running batch (a decoder) and turns the loop: the scheduler (worker/engine/scheduler.py) takes queued
jobs in and plans the turn (`StepPlan`); the core runs the plan on the decoder (a prefill pass, a
trace pass or a chunk of a long text, then one decoding step of the running batch) and hands back
what it took (`StepOutcome`).

Jobs arrive prepared (claimed and tokenized on another thread: nothing here waits on Redis or a
tokenizer), and every job taken in gets exactly one answer (`done`): its ended sequence or its
failure. A pass, chunk or step that fails is its jobs' failure, never the engine's: out of memory,
a pass runs in halves down to one job. An exception that escapes the loop is a bug in the engine:
the thread calls `on_death` (its watchdog), which by default ends the engine process (its jobs
then go back to the queue as after `kill -9`, and the worker starts a new engine).

Exclusive runs (`Alone`: trusted nnsight code, when it shares this engine) take the model between
two turns of the loop: one per turn, owners in turn, and after one that paused a running batch the
batch is served as long again before the next. One whose answer says the process cannot be
proven whole stops the loop for good (`on_replace`: the process is replaced once it is answered).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import JobFailure
from worker.batch.oom import in_halves, release_cached
from worker.batch.running_batch import RunningBatch
from worker.batch.sequence import Feeding, Sequence
from worker.engine.scheduler import TRACE_PADDING, Entry, Feed, Scheduler, StepOutcome, StepPlan
from worker.rules.failures import answer_of, is_oom

if TYPE_CHECKING:
    from worker.batch.served import ServedModel

log = logging.getLogger(__name__)
clock = time.perf_counter  # what prefill work and decoding steps are timed with (fair share)
ENGINE_THREAD_DIED = 70  # the engine process's exit status when its thread died (EX_SOFTWARE)
EXIT_GRACE_S = 5.0  # the most the dying process spends saying why before it ends regardless
# Told the engine thread's fatal error before the process ends (worker/engine/process.py: the worker hears it).
last_words: Callable[[str], None] | None = None


def exit_process(exc: BaseException) -> None:
    """End the process because the engine thread died, saying why on the way, and never hang or
    raise on the way: whatever the dying thread left behind (a recursion limit of 30, a logging
    lock, an exception whose `str` raises), the process ends within EXIT_GRACE_S."""
    try:
        threading.Timer(EXIT_GRACE_S, os._exit, args=(ENGINE_THREAD_DIED,)).start()
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
        try:
            text = f"{type(exc).__name__}: {exc}"[:2000]
        except BaseException:  # noqa: BLE001 - its __str__ may raise too
            text = type(exc).__name__
        with contextlib.suppress(BaseException):
            if last_words is not None:
                last_words(text)
        with contextlib.suppress(BaseException):
            logging.getLogger("actq.engine").critical(
                "the engine thread died (%s); exiting so that the worker restarts the engine and its jobs are run "
                "again",
                text,
                exc_info=exc,
            )
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
    finally:
        os._exit(ENGINE_THREAD_DIED)


@dataclass
class Alone:
    """Work that needs the model to itself (an nnsight job, worker/nnsight/jobs.py): run on the
    engine thread between two decoding steps, the running batch paused. `run()`'s value or
    exception is its answer (`done`); `started()` is called as it begins. `owner`: whose it is
    (runs of different owners take turns). An answer with a non-empty `unproven` list (trusted
    code left the process in a state it cannot prove whole) stops the engine: `on_replace(job_id,
    reasons)` is told before the answer, and nothing runs after it."""

    run: Callable[[], Any]
    done: Callable[[Any], None]
    started: Callable[[], None] = lambda: None
    job_id: str = ""
    owner: str | None = None


def _unproven(outcome: object) -> list[str]:
    """What an exclusive run's answer says it could not prove whole (worker/nnsight/guard.py)."""
    try:
        found = getattr(outcome, "unproven", None)
        return [str(reason) for reason in found] if isinstance(found, list) and found else []
    except Exception:  # noqa: BLE001 - an answer from trusted code may be anything
        return ["an exclusive run's answer could not be read"]


@dataclass
class StepStats:
    """What the engine core did, for metrics: the batch size of every decoding step and the
    tokens decoded, since the last `take` (and in total)."""

    steps: int = 0
    tokens: int = 0
    largest: int = 0  # the largest batch a step ran
    cache: tuple[int, int, int] = (0, 0, 0)  # the decoder's KV cache now: bytes, slots, positions per slot
    _pending: list[int] = field(default_factory=list)
    _pending_tokens: int = 0
    _holds: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def held(self, seconds: float) -> None:
        """An exclusive run (an nnsight job) had the model to itself for `seconds`."""
        with self._lock:
            self._holds.append(seconds)

    def take_holds(self) -> list[float]:
        """The exclusive runs' hold times since the last take (the heartbeat sends them to Redis)."""
        with self._lock:
            holds, self._holds = self._holds, []
        return holds

    def add(self, size: int, tokens: int) -> None:
        with self._lock:
            self.steps += 1 if size else 0
            self.tokens += tokens
            if size:
                self.largest = max(self.largest, size)
                self._pending.append(size)
            self._pending_tokens += tokens

    def take(self) -> tuple[list[int], int]:
        """Step sizes and tokens since the last take (the heartbeat sends them to Redis)."""
        with self._lock:
            sizes, tokens = self._pending, self._pending_tokens
            self._pending, self._pending_tokens = [], 0
        return sizes, tokens


class EngineCore:
    """The engine thread over `served`'s decoder, with a scheduler of `max_batch` sequences and
    `budget_bytes` (see worker/engine/scheduler.py); `chunk_tokens`: prompts longer than this are fed in
    chunks beside a running batch."""

    def __init__(
        self,
        served: ServedModel,
        max_batch: int,
        wait_s: float = 0.0,
        budget_bytes: int = 0,
        on_death: Callable[[BaseException], None] = exit_process,
        chunk_tokens: int | None = None,
        prefill_padding: float = TRACE_PADDING,
        on_replace: Callable[[str, list[str]], None] | None = None,
    ) -> None:
        self.served, self.max_batch = served, max_batch
        self.scheduler = Scheduler(served.trace_cost, max_batch, wait_s, budget_bytes, prefill_padding)
        self.on_death = on_death
        self.on_replace = on_replace
        self.chunk_tokens = chunk_tokens
        self.stats = StepStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="actq-engine", daemon=True)
        self._feeds: dict[int, Feeding] = {}  # id(sequence) -> its long text fed so far
        self._alones: dict[str | None, deque[Alone]] = {}  # exclusive runs waiting, by owner
        self._turns: deque[str | None] = deque()  # owners with runs waiting, in the order they take turns
        self._alone_lock = threading.Lock()
        self.alone_owed = 0.0  # seconds the batch is owed for the last exclusive run, before the next one
        self.replaced: list[str] | None = None  # why the engine stopped to be replaced (trusted code)
        self.paused_s: list[float] = []  # how long each `Alone` held the model (the batch paused)

    def start(self) -> EngineCore:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, entry: Entry) -> None:
        self.scheduler.submit(entry)

    def run_alone(self, item: Alone) -> None:
        """Run `item` with the model to itself at a turn of the loop, one at a time: owners take
        turns, and after a run that paused a running batch, the batch runs as long again before
        the next one."""
        with self._alone_lock:
            if item.owner not in self._alones:
                self._alones[item.owner] = deque()
                self._turns.append(item.owner)
            self._alones[item.owner].append(item)
        self.scheduler.wake()

    def _next_alone(self) -> Alone | None:
        with self._alone_lock:
            if not self._turns:
                return None
            owner = self._turns.popleft()
            waiting = self._alones[owner]
            item = waiting.popleft()
            if waiting:
                self._turns.append(owner)  # its next run waits for the other owners'
            else:
                del self._alones[owner]
            return item

    def _loop(self) -> None:
        try:
            with self.served.lock, torch.inference_mode():
                decoder = self.served.decoder(self.max_batch)
                if self.max_batch > 1:  # a batch of one has nothing to interleave with: stays exact
                    decoder.chunk_tokens = self.chunk_tokens
                try:
                    while not self._stop.is_set():
                        self.tick(decoder)
                finally:
                    decoder.close()
        except BaseException as exc:  # noqa: BLE001 - nothing may end this thread silently
            self.on_death(exc)

    def tick(self, decoder: RunningBatch) -> None:
        """One turn of the loop, in vLLM v1's three stages: the scheduler takes queued jobs in
        (waiting up to half a second for one when nothing runs) and plans the turn (`schedule`);
        the core runs the plan on the running batch (`execute`); the scheduler reads back what it
        took (`update_from_output`). Each row's rules are applied inside the batch's step
        (worker/batch/row_rules.py)."""
        scheduler = self.scheduler
        scheduler.take_in(decoder)
        self._run_alone(decoder)
        if self.replaced is not None:
            return
        plan = scheduler.schedule(decoder)
        scheduler.update_from_output(plan, self.execute(decoder, plan))

    def execute(self, decoder: RunningBatch, plan: StepPlan) -> StepOutcome:
        """Run `plan`: its unit of prefill work, then one decoding step when rows decode by then;
        every job the turn ends gets its answer. Returns what each part took."""
        outcome = StepOutcome()
        if (work := plan.prefill) is not None:
            began = clock()
            if isinstance(work, Feed):
                self._feed(decoder, work.entry)
            else:
                for entry in work.entries:
                    self._started(entry)  # its time limit counts from its own pass
                if work.trace:
                    self._trace_pass(decoder, work.entries)
                else:
                    self._admit_group(decoder, work.entries)
            outcome.prefill_s = clock() - began
            self._served(outcome.prefill_s)
        if not decoder.rows:
            decoder.idle()  # the KV cache may give its memory back
        if not (plan.decode and decoder.rows):
            self.stats.cache = decoder.cache_size()
            return outcome
        began = clock()
        self._step(decoder)
        outcome.decode_s = clock() - began
        self._served(outcome.decode_s)
        self.stats.cache = decoder.cache_size()
        return outcome

    def _busy(self, decoder: RunningBatch) -> bool:
        """Other jobs are running or waiting for their first pass: an exclusive run pauses them."""
        return bool(decoder.rows or self.scheduler.waiting or self.scheduler.feeding)

    def _served(self, seconds: float) -> None:
        self.alone_owed = max(0.0, self.alone_owed - seconds)

    def _run_alone(self, decoder: RunningBatch) -> None:
        """The next `Alone` in turn, unless the running batch is still owed time for the last one:
        its own failure is its answer, never the engine's."""
        busy = self._busy(decoder)
        if busy and self.alone_owed > 0:
            return
        item = self._next_alone()
        if item is None:
            return
        began = clock()
        outcome: object
        try:
            try:
                item.started()
                with self.served.gate.exclusive():  # no other thread reads the tokenizer meanwhile
                    outcome = item.run()
            except BaseException as exc:  # noqa: BLE001 - trusted code: whatever it raises is its own
                outcome = exc
        except BaseException as exc:  # noqa: BLE001 - raised late, as the first was handled
            outcome = exc
        held = clock() - began
        self.paused_s.append(held)
        del self.paused_s[:-1000]
        self.stats.held(held)
        self.alone_owed = held if busy else 0.0
        unproven = _unproven(outcome)
        if unproven:  # nothing may run on this process again: it is replaced once this run is answered
            self.replaced = unproven
            self._stop.set()
            if self.on_replace is not None:
                try:
                    self.on_replace(item.job_id, unproven)
                except Exception:  # a callback's bug must not end the engine thread
                    log.exception("asking for the engine's replacement failed")
        try:
            item.done(outcome)
        except Exception:  # a callback's bug must not end the engine thread
            log.exception("handing an exclusive run's outcome back failed")

    # -- answers -------------------------------------------------------------------------------

    def waiting_alone(self) -> int:
        """Exclusive runs waiting for their turn."""
        with self._alone_lock:
            return sum(len(q) for q in self._alones.values())

    def _done(self, entry: Entry, outcome: Sequence | JobFailure | Exception) -> None:
        """`entry`'s one answer; it no longer holds memory or a place."""
        self.scheduler.answered(entry)
        self._feeds.pop(id(entry.seq), None)
        try:
            entry.done(outcome)
        except Exception:  # a callback's bug must not end the engine thread
            log.exception("handing a job's outcome back failed")

    @staticmethod
    def _started(entry: Entry) -> None:
        try:
            entry.started()
        except Exception:  # a callback's bug must not end the engine thread
            log.exception("announcing a job's start failed")

    # -- running the scheduler's picks ---------------------------------------------------------

    def _feed(self, decoder: RunningBatch, entry: Entry) -> None:
        """One chunk of a long text; its job is answered when the text is all fed and it ended
        (a trace, or a generation whose first token ended it) or failed; a generation that goes
        on has joined the running batch."""
        item = self._feeds.setdefault(id(entry.seq), Feeding(entry.seq))
        if item.fed == 0:
            self._started(entry)  # its time limit counts from its first chunk
        chunk = decoder.chunk_tokens or item.seq.prompt_tokens
        try:
            fed = decoder.feed(item, chunk)
        except Exception as exc:  # a chunk's failure is its job's, never the batch's
            if not is_oom(exc):
                log.error("feeding a prompt failed; failing its job", exc_info=exc)
            else:
                release_cached()
            self.scheduler.fed(entry)
            self._done(entry, answer_of(exc))
            return
        if not fed:
            return
        self.scheduler.fed(entry)
        self._feeds.pop(id(entry.seq), None)
        self.stats.add(*((1, 0) if item.seq.trace else (0, 1)))  # a trace pass; a generation's first token
        if item.seq.ended is not None:
            self._done(entry, item.seq)

    def _admit_group(self, decoder: RunningBatch, group: list[Entry]) -> None:
        """Prefill `group` in one pass and let its jobs join the running batch. A pass that fails
        (out of memory, or one job's own failure) runs again in halves, worker/batch/oom.py's policy
        on any failure: only a job that fails alone fails, found in a few passes."""
        seqs = [entry.seq for entry in group]

        def run(lo: int, hi: int) -> None:
            try:
                decoder.admit_many(seqs[lo:hi])  # all or nothing: a failed pass left every job as before
            except Exception as exc:
                if hi - lo > 1 and not is_oom(exc):
                    log.warning("a prefill of %d jobs failed (%s: %s): in halves", hi - lo, type(exc).__name__, exc)
                raise
            self.stats.add(0, hi - lo)  # each one's first token came from the prefill
            for entry in group[lo:hi]:
                if entry.seq.ended is not None:
                    self._done(entry, entry.seq)

        def fail(lo: int, hi: int, exc: Exception) -> None:
            failure = answer_of(exc)
            for entry in group[lo:hi]:
                self._done(entry, failure)

        in_halves(0, len(group), run, fail, splits=lambda exc: True)

    def _trace_pass(self, decoder: RunningBatch, group: list[Entry]) -> None:
        """One forward pass over `group`; out of memory, worker/batch/oom.py's policy (in halves, down to
        one job, which then fails alone). Any other failure fails the jobs of this pass, and only them."""
        seqs = [entry.seq for entry in group]
        marks = [seq.capture.mark() if seq.capture else None for seq in seqs]

        def run(lo: int, hi: int) -> None:
            try:
                decoder.trace(seqs[lo:hi])
            except Exception as exc:  # a pass's failure is its jobs', never the engine's
                if is_oom(exc):
                    raise
                fail(lo, hi, exc)
                return
            self.stats.add(hi - lo, 0)
            for entry in group[lo:hi]:
                self._done(entry, entry.seq)

        def undo(lo: int, hi: int) -> None:
            for seq, mark in zip(seqs[lo:hi], marks[lo:hi], strict=True):
                if seq.capture is not None and mark is not None:
                    seq.capture.reset(mark)
                if seq.scores is not None:
                    seq.scores = type(seq.scores)(seq.scores.k)

        def fail(lo: int, hi: int, exc: Exception) -> None:
            if not is_oom(exc):
                log.error("a trace pass failed; failing the %d jobs in it", hi - lo, exc_info=exc)
            failure = answer_of(exc)
            for entry in group[lo:hi]:
                self._done(entry, failure)

        in_halves(0, len(group), run, fail, undo)

    def _step(self, decoder: RunningBatch) -> None:
        """One decoding step. Rows that end leave with their results (the decoder never loses
        one); a step that fails as a whole fails the rows still running, and the engine goes on."""
        live = [entry for seq in decoder.rows if (entry := self.scheduler.entry_of(seq)) is not None]
        try:
            ended = decoder.step()
        except Exception as exc:  # the step's failure is its jobs', never the engine's
            log.error("a decoding step failed; failing the %d jobs in it", len(live), exc_info=exc)
            failure: Exception = answer_of(exc)
            decoder.reset()
            for entry in live:
                self._done(entry, failure)
            return
        self.stats.add(len(live), len(live))
        for seq in ended:
            entry = self.scheduler.entry_of(seq)
            if entry is not None:
                self._done(entry, seq)

"""The engine thread: the only thread that runs the model. It keeps one running batch (a
`Decoder`) and, between decoding steps, lets queued jobs join it while there is room: at most
`max_batch` sequences and, together, at most `budget_bytes` of estimated KV cache and capture
buffers (a job alone always runs, whatever its estimate). A sequence leaves the batch the step it
ends and its slot is free for the next job at the next step (iteration-level scheduling).

When the batch is empty it waits for a job, then up to `wait_s` for more to arrive, so that a
burst of submissions starts together. Jobs taken in wait for their prefill: generations of
similar prompt lengths prefill in one left-padded pass, trace jobs run in passes of their own, and
a text longer than the decoder's chunk is fed a chunk at a time; while jobs decode, this prefill
work gets at most about half of the engine's time (`tick`), so nothing freezes a running batch.

Jobs arrive prepared (claimed and tokenized on another thread: nothing here waits on Redis or a
tokenizer), and every job taken in gets exactly one answer (`done`): its ended sequence or its
failure. An exception that escapes the loop is a bug in the engine, not a job's failure: the
thread calls `on_death`, which by default ends the engine process (its jobs then go back to the
queue as after `kill -9`, and the worker starts a new engine).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.errors import JobFailure, OutOfMemory
from worker.decoding import OUT_OF_MEMORY, Decoder, Feeding, Sequence, is_oom
from worker.engine import CaptureEngine

log = logging.getLogger(__name__)
TRACE_PADDING = 0.1  # the most of a trace pass's positions that may be padding
clock = time.perf_counter  # what prefill work and decoding steps are timed with (fair share)


@dataclass
class Entry:
    """A job handed to the engine thread: its prepared sequence; `done` gets the ended sequence or
    the failure and must not block (it hands the result to another thread); `started` is called
    when it joins a batch (its time limit counts from then); `estimate` is the bytes it holds
    while it runs (the memory budget)."""

    seq: Sequence
    done: Callable[[Sequence | JobFailure | Exception], None]
    estimate: int = 0
    started: Callable[[], None] = lambda: None
    joined: float = field(default_factory=time.monotonic)


ENGINE_THREAD_DIED = 70  # the engine process's exit status when its thread died (EX_SOFTWARE)


def exit_process(exc: BaseException) -> None:
    logging.getLogger("actq.engine").critical(
        "the engine thread died (%s: %s); exiting so that the worker restarts the engine and its jobs are run again",
        type(exc).__name__,
        exc,
        exc_info=exc,
    )
    logging.shutdown()
    os._exit(ENGINE_THREAD_DIED)


@dataclass
class StepStats:
    """What the engine thread did, for metrics: the batch size of every decoding step and the
    tokens decoded, since the last `take` (and in total)."""

    steps: int = 0
    tokens: int = 0
    largest: int = 0  # the largest batch a step ran
    _pending: list[int] = field(default_factory=list)
    _pending_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

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


class Scheduler:
    def __init__(
        self,
        engine: CaptureEngine,
        max_batch: int,
        wait_s: float = 0.0,
        budget_bytes: int = 0,
        on_death: Callable[[BaseException], None] = exit_process,
        chunk_tokens: int | None = None,
        prefill_padding: float = TRACE_PADDING,
    ) -> None:
        self.engine, self.max_batch, self.wait_s, self.budget = engine, max_batch, wait_s, budget_bytes
        self.prefill_padding = prefill_padding  # the most of a pass's positions that may be padding
        self.on_death = on_death
        self.chunk_tokens = chunk_tokens  # for the decoder: prompts longer than this feed in chunks
        self.inbox: queue.Queue[Entry] = queue.Queue()
        self.stats = StepStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="actq-engine", daemon=True)
        # Every job taken in and not yet answered: id(sequence) -> (entry, estimated bytes).
        self._active: dict[int, tuple[Entry, int]] = {}
        self._arrived: dict[int, int] = {}  # id(sequence) -> the order it was taken in
        self._counter = itertools.count()
        self._waiting: list[Entry] = []  # taken in, waiting for their prefill or trace pass
        self._feeding: list[tuple[Entry, Feeding]] = []  # long texts fed a chunk at a time, in order
        self._owed = 0.0  # seconds of decoding owed to the running batch for prefill work done

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, entry: Entry) -> None:
        self.inbox.put(entry)

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            with self.engine.lock, torch.inference_mode():
                decoder = self.engine.decoder(self.max_batch)
                if self.max_batch > 1:  # a batch of one has nothing to interleave with: stays exact
                    decoder.chunk_tokens = self.chunk_tokens
                try:
                    while not self._stop.is_set():
                        self.tick(decoder)
                finally:
                    decoder.close()
        except BaseException as exc:  # noqa: BLE001 - nothing may end this thread silently
            self.on_death(exc)

    def tick(self, decoder: Decoder) -> None:
        """One turn of the loop: take queued jobs in (waiting up to half a second for one when
        nothing runs), run prefill work (`_prefill_one`: a pass of jobs taken in, or a chunk of a
        long prompt) while the running batch is not owed time, then one decoding step.

        Fair share: while jobs decode, prefill work gets at most about half the engine's time.
        The time a prefill pass or chunk took is owed to the running batch, which then decodes
        until it has had as much; so a long trace or a burst of prompts slows running jobs down
        about twofold at most, never freezes them. With nothing decoding, prefill work runs
        back to back."""
        self._take_in(decoder)
        while (self._waiting or self._feeding) and (not decoder.rows or self._owed <= 0):
            began = clock()
            self._prefill_one(decoder)
            if decoder.rows:
                self._owed += max(clock() - began, 1e-9)
        if not decoder.rows:
            self._owed = 0.0
            return
        began = clock()
        self._step(decoder)
        self._owed = max(0.0, self._owed - (clock() - began))

    @staticmethod
    def _answer(entry: Entry, outcome: Sequence | JobFailure | Exception) -> None:
        try:
            entry.done(outcome)
        except Exception:  # a callback's bug must not end the engine thread
            log.exception("handing a job's outcome back failed")

    def _room(self, decoder: Decoder) -> int:
        most = self.max_batch if decoder.most_rows is None else min(self.max_batch, decoder.most_rows)
        return most - len(decoder.rows) - len(self._waiting) - len(self._feeding)

    def _take_in(self, decoder: Decoder) -> None:
        """Take queued jobs in while there is room (jobs waiting for their prefill and long ones
        being fed count against `max_batch`); when nothing runs, wait for one (then `wait_s` for
        company, so that a burst starts together)."""
        if not decoder.rows and not self._waiting and not self._feeding:
            try:
                first = self.inbox.get(timeout=0.5)  # wakes only to notice `stop`
            except queue.Empty:
                return
            self._consider(decoder, first)
            deadline = time.monotonic() + self.wait_s
            while self._room(decoder) > 0 and (left := deadline - time.monotonic()) > 0:
                try:
                    entry = self.inbox.get(timeout=left)
                except queue.Empty:
                    break
                if not self._consider(decoder, entry):
                    break
        while self._room(decoder) > 0:
            try:
                entry = self.inbox.get_nowait()
            except queue.Empty:
                break
            if not self._consider(decoder, entry):
                break

    def _consider(self, decoder: Decoder, entry: Entry) -> bool:
        """Take `entry` in: a text longer than the decoder's chunk is fed in chunks
        (`_feeding`), any other waits in `_waiting` for a prefill or trace pass. False when it
        must wait for room in the memory budget (a job alone always runs)."""
        seq = entry.seq
        cost = self.engine.trace_cost(seq, seq.prompt_tokens) if seq.trace else entry.estimate
        used = sum(c for _, c in self._active.values())
        if self._active and self.budget and used + cost > self.budget:
            self._requeue(entry)
            return False
        self._active[id(seq)] = (entry, cost)
        self._arrived[id(seq)] = next(self._counter)
        if decoder.chunk_tokens is not None and seq.prompt_tokens > decoder.chunk_tokens:
            self._feeding.append((entry, Feeding(seq)))
        else:
            self._waiting.append(entry)
        return True

    def _done(self, entry: Entry, outcome: Sequence | JobFailure | Exception) -> None:
        """`entry`'s one answer; it no longer holds memory or a place."""
        self._active.pop(id(entry.seq), None)
        self._arrived.pop(id(entry.seq), None)
        self._answer(entry, outcome)

    def _prefill_one(self, decoder: Decoder) -> None:
        """One unit of prefill work, for the job that arrived first: the pass of jobs waiting
        that it belongs to (a prefill of generations, or a trace pass), or the next chunk of its
        long text."""
        first_waiting = min(self._waiting, key=lambda e: self._arrived[id(e.seq)], default=None)
        if self._feeding and (
            first_waiting is None or self._arrived[id(self._feeding[0][0].seq)] < self._arrived[id(first_waiting.seq)]
        ):
            self._feed(decoder)
            return
        assert first_waiting is not None
        kind = first_waiting.seq.trace, decoder.wants_logits(first_waiting.seq)
        alike = [e for e in self._waiting if (e.seq.trace, decoder.wants_logits(e.seq)) == kind]
        cap = decoder.chunk_tokens if decoder.rows else None  # beside decoding jobs: about a chunk's work
        group = next(g for g in self._passes(alike, cap) if any(e is first_waiting for e in g))
        self._waiting = [e for e in self._waiting if all(e is not g for g in group)]
        for entry in group:
            self._started(entry)  # its time limit counts from its own pass
        if kind[0]:
            self._trace_pass(decoder, group)
        else:
            self._admit_group(decoder, group)

    def _feed(self, decoder: Decoder) -> None:
        """One chunk of the oldest long text; its job is answered when the text is all fed and
        it ended (a trace, or a generation whose first token ended it) or failed; a generation
        that goes on has joined the running batch."""
        entry, item = self._feeding[0]
        if item.fed == 0:
            self._started(entry)  # its time limit counts from its first chunk
        chunk = decoder.chunk_tokens or item.seq.prompt_tokens
        try:
            fed = decoder.feed(item, chunk)
        except Exception as exc:  # a chunk's failure is its job's, never the batch's
            if not is_oom(exc):
                log.error("feeding a prompt failed; failing its job", exc_info=exc)
            elif torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._feeding.pop(0)
            self._done(entry, OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc)
            return
        if not fed:
            return
        self._feeding.pop(0)
        self.stats.add(*((1, 0) if item.seq.trace else (0, 1)))  # a trace pass; a generation's first token
        if item.seq.ended is not None:
            self._done(entry, item.seq)

    def _admit_group(self, decoder: Decoder, group: list[Entry]) -> None:
        """Prefill `group` in one pass and let its jobs join the running batch; if the pass
        fails, each job runs alone, so that only a job that fails alone fails."""
        try:
            decoder.admit_many([entry.seq for entry in group])  # all or nothing, jobs included
        except Exception as exc:  # noqa: BLE001 - a prefill's failure is its jobs', never the engine's
            if len(group) > 1:
                log.warning(
                    "a prefill of %d jobs failed (%s: %s): each runs alone", len(group), type(exc).__name__, exc
                )
                if is_oom(exc) and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                for entry in group:
                    self._admit_group(decoder, [entry])
                return
            self._done(group[0], OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc)
            return
        self.stats.add(0, len(group))  # each one's first token came from the prefill
        for entry in group:
            if entry.seq.ended is not None:
                self._done(entry, entry.seq)

    def _passes(self, entries: list[Entry], cap: int | None = None) -> list[list[Entry]]:
        """`entries` in passes of similar lengths: sorted, and a pass ends before padding would
        exceed `prefill_padding` (TRACE_PADDING) of its positions (padding is computed and thrown
        away: on a CPU, where a batch computes no faster per position, it is pure loss), its padded size the
        memory budget, or its padded positions `cap` (a job alone always runs)."""
        passes: list[list[Entry]] = []
        group: list[Entry] = []
        for entry in sorted(entries, key=lambda e: e.seq.prompt_tokens):
            padded = entry.seq.prompt_tokens  # sorted: the newest is the longest
            cost = sum(self.engine.trace_cost(e.seq, padded) for e in [*group, entry])
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

    def _started(self, entry: Entry) -> None:
        try:
            entry.started()
        except Exception:  # a callback's bug must not end the engine thread
            log.exception("announcing a job's start failed")

    def _trace_pass(self, decoder: Decoder, group: list[Entry]) -> None:
        """One forward pass over `group`; out of memory, it runs in halves, down to one job, which
        then fails alone. Any other failure fails the jobs of this pass, and only them."""
        seqs = [entry.seq for entry in group]
        try:
            marks = [seq.capture.mark() if seq.capture else None for seq in seqs]
            decoder.trace(seqs)
        except Exception as exc:  # a pass's failure is its jobs', never the engine's
            if is_oom(exc) and len(group) > 1:
                try:
                    for seq, mark in zip(seqs, marks, strict=True):
                        if seq.capture is not None and mark is not None:
                            seq.capture.reset(mark)
                        if seq.scores is not None:
                            seq.scores = type(seq.scores)(seq.scores.k)
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                except Exception as undo:  # noqa: BLE001 - cannot undo: fail the pass's jobs
                    exc = undo
                else:
                    half = len(group) // 2
                    self._trace_pass(decoder, group[:half])
                    self._trace_pass(decoder, group[half:])
                    return
            failure: Exception = OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc
            if not is_oom(exc):
                log.error("a trace pass failed; failing the %d jobs in it", len(group), exc_info=exc)
            for entry in group:
                self._done(entry, failure)
            return
        self.stats.add(len(group), 0)
        for entry in group:
            self._done(entry, entry.seq)

    def _requeue(self, entry: Entry) -> None:
        """Over budget: back to the head of the line."""
        with self.inbox.mutex:
            self.inbox.queue.appendleft(entry)
            self.inbox.not_empty.notify()

    def _step(self, decoder: Decoder) -> None:
        """One decoding step. Rows that end leave with their results (the decoder never loses
        one); a step that fails as a whole fails the rows still running, and the engine goes on."""
        live = [seq for seq in decoder.rows if id(seq) in self._active]
        try:
            ended = decoder.step()
        except Exception as exc:  # the step's failure is its jobs', never the engine's
            log.error("a decoding step failed; failing the %d jobs in it", len(live), exc_info=exc)
            failure: Exception = OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc
            decoder.reset()
            for seq in live:
                self._done(self._active[id(seq)][0], failure)
            return
        self.stats.add(len(live), len(live))
        for seq in ended:
            self._done(self._active[id(seq)][0], seq)

"""The engine thread: the only thread that runs the model. It keeps one running batch (a
`Decoder`) and, between decoding steps, lets queued jobs join it while there is room: at most
`max_batch` sequences and, together, at most `budget_bytes` of estimated KV cache and capture
buffers (a job alone always runs, whatever its estimate). A sequence leaves the batch the step it
ends and its slot is free for the next job at the next step (iteration-level scheduling).

When the batch is empty it waits for a job, then up to `wait_s` for more to arrive, so that a
burst of submissions starts together.

Jobs arrive prepared (claimed and tokenized on another thread: nothing here waits on Redis or a
tokenizer), and every job taken in gets exactly one answer (`done`): its ended sequence or its
failure. An exception that escapes the loop is a bug in the engine, not a job's failure: the
thread calls `on_death`, which by default ends the engine process (its jobs then go back to the
queue as after `kill -9`, and the worker starts a new engine).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.errors import JobFailure, OutOfMemory
from worker.decoding import OUT_OF_MEMORY, Decoder, Sequence, is_oom
from worker.engine import CaptureEngine

log = logging.getLogger(__name__)
TRACE_PADDING = 0.1  # the most of a trace pass's positions that may be padding


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
    ) -> None:
        self.engine, self.max_batch, self.wait_s, self.budget = engine, max_batch, wait_s, budget_bytes
        self.on_death = on_death
        self.inbox: queue.Queue[Entry] = queue.Queue()
        self.stats = StepStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="actq-engine", daemon=True)
        self._active: dict[int, tuple[Entry, int]] = {}  # id(sequence) -> (entry, estimated bytes)
        self._traces: list[Entry] = []  # trace jobs taken in by this `_fill`

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
                decoder = self.engine.decoder()
                try:
                    while not self._stop.is_set():
                        self.tick(decoder)
                finally:
                    decoder.close()
        except BaseException as exc:  # noqa: BLE001 - nothing may end this thread silently
            self.on_death(exc)

    def tick(self, decoder: Decoder) -> None:
        """One turn of the loop: let queued jobs join (waiting up to half a second for one when
        the batch is empty), run the trace jobs taken in, then one decoding step."""
        self._fill(decoder)
        if decoder.rows:
            self._step(decoder)

    @staticmethod
    def _answer(entry: Entry, outcome: Sequence | JobFailure | Exception) -> None:
        try:
            entry.done(outcome)
        except Exception:  # a callback's bug must not end the engine thread
            log.exception("handing a job's outcome back failed")

    def _room(self, decoder: Decoder, joining: list[Entry] | tuple[()] = ()) -> int:
        most = self.max_batch if decoder.most_rows is None else min(self.max_batch, decoder.most_rows)
        return most - len(decoder.rows) - len(self._traces) - len(joining)

    def _fill(self, decoder: Decoder) -> None:
        """Let queued jobs join, then run the trace jobs taken in."""
        try:
            self._take_in(decoder)
        finally:
            traces, self._traces = self._traces, []
            if traces:
                self._run_traces(decoder, traces)

    def _take_in(self, decoder: Decoder) -> None:
        """Take queued jobs in while there is room; when nothing runs, wait for one (then `wait_s`
        for company). The jobs taken in prefill together (`_admit`); trace jobs count against
        `max_batch` here too, so at most a batch of them is taken in at once."""
        joining: list[Entry] = []
        try:
            if not decoder.rows:
                try:
                    first = self.inbox.get(timeout=0.5)  # wakes only to notice `stop`
                except queue.Empty:
                    return
                self._consider(decoder, first, joining)
                deadline = time.monotonic() + self.wait_s
                while self._room(decoder, joining) > 0 and (left := deadline - time.monotonic()) > 0:
                    try:
                        entry = self.inbox.get(timeout=left)
                    except queue.Empty:
                        break
                    if not self._consider(decoder, entry, joining):
                        break
            while self._room(decoder, joining) > 0:
                try:
                    entry = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._consider(decoder, entry, joining):
                    break
        finally:
            if joining:
                self._admit(decoder, joining)

    def _consider(self, decoder: Decoder, entry: Entry, joining: list[Entry]) -> bool:
        """Take `entry` in (a trace job waits in `_traces` for the trace pass at the end of
        `_fill`); False when it must wait for room in the memory budget (a job alone always runs)."""
        if entry.seq.trace:
            self._traces.append(entry)
            return True
        used = sum(c for _, c in self._active.values()) + sum(e.estimate for e in joining)
        if (decoder.rows or joining) and self.budget and used + entry.estimate > self.budget:
            self._requeue(entry)
            return False
        joining.append(entry)
        return True

    def _admit(self, decoder: Decoder, joining: list[Entry]) -> None:
        """Prefill the jobs taken in: those of similar prompt lengths in one left-padded pass (the
        trace passes' padding and memory rules), then join the running batch."""
        for entry in joining:
            self._started(entry)
        for group in self._passes(joining):
            self._admit_group(decoder, group)

    def _admit_group(self, decoder: Decoder, group: list[Entry]) -> None:
        try:
            decoder.admit_many([entry.seq for entry in group])  # all or nothing, jobs included
        except Exception as exc:  # noqa: BLE001 - a prefill's failure is its jobs', never the engine's
            if len(group) > 1:  # each alone, so that only a job that fails alone fails
                log.warning(
                    "a prefill of %d jobs failed (%s: %s): each runs alone", len(group), type(exc).__name__, exc
                )
                if is_oom(exc) and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                for entry in group:
                    self._admit_group(decoder, [entry])
                return
            self._answer(group[0], OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc)
            return
        self.stats.add(0, len(group))  # each one's first token came from the prefill
        for entry in group:
            if entry.seq.ended is not None:
                self._answer(entry, entry.seq)
            else:
                self._active[id(entry.seq)] = (entry, entry.estimate)

    def _passes(self, entries: list[Entry]) -> list[list[Entry]]:
        """`entries` in passes of similar lengths: sorted, and a pass ends before padding would
        exceed TRACE_PADDING of its positions (padding is computed and thrown away: on a CPU,
        where a batch computes no faster per position, it is pure loss) or its padded size the
        memory budget (a job alone always runs)."""
        passes: list[list[Entry]] = []
        group: list[Entry] = []
        for entry in sorted(entries, key=lambda e: e.seq.prompt_tokens):
            padded = entry.seq.prompt_tokens  # sorted: the newest is the longest
            cost = sum(self.engine.trace_cost(e.seq, padded) for e in [*group, entry])
            positions = padded * (len(group) + 1)
            real = padded + sum(e.seq.prompt_tokens for e in group)
            if group and (positions - real > TRACE_PADDING * positions or (self.budget and cost > self.budget)):
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

    def _run_traces(self, decoder: Decoder, traces: list[Entry]) -> None:
        """The trace jobs in passes of similar lengths (`_passes`)."""
        for entry in traces:
            self._started(entry)
        for group in self._passes(traces):
            self._trace_pass(decoder, group)

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
                self._answer(entry, failure)
            return
        self.stats.add(len(group), 0)
        for entry in group:
            self._answer(entry, entry.seq)

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
                entry, _ = self._active.pop(id(seq))
                self._answer(entry, failure)
            return
        self.stats.add(len(live), len(live))
        for seq in ended:
            entry, _ = self._active.pop(id(seq))
            self._answer(entry, seq)

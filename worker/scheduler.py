"""The engine thread: the only thread that runs the model. It keeps one running batch (a
`Decoder`) and, between decoding steps, lets queued jobs join it while there is room: at most
`max_batch` sequences and, together, at most `budget_bytes` of estimated KV cache and capture
buffers (a job alone always runs, whatever its estimate). A sequence leaves the batch the step it
ends and its slot is free for the next job at the next step (iteration-level scheduling).

When the batch is empty it waits for a job, then up to `wait_s` for more to arrive, so that a
burst of submissions starts together.
"""

from __future__ import annotations

import logging
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
    """A job handed to the engine thread. `prepare` builds its sequence (in the engine thread,
    raising the job's failure); `done` gets the ended sequence or the failure, and must not block
    (it hands the result to another thread)."""

    prepare: Callable[[], Sequence]
    done: Callable[[Sequence | JobFailure | Exception], None]
    estimate: Callable[[Sequence], int] = lambda _: 0
    joined: float = field(default_factory=time.monotonic)


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
    def __init__(self, engine: CaptureEngine, max_batch: int, wait_s: float = 0.0, budget_bytes: int = 0) -> None:
        self.engine, self.max_batch, self.wait_s, self.budget = engine, max_batch, wait_s, budget_bytes
        self.inbox: queue.Queue[Entry] = queue.Queue()
        self.stats = StepStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="actq-engine", daemon=True)
        self._active: dict[int, tuple[Entry, int]] = {}  # id(sequence) -> (entry, estimated bytes)
        self._traces: list[tuple[Entry, Sequence]] = []  # trace jobs taken in by this `_fill`

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def submit(self, entry: Entry) -> None:
        self.inbox.put(entry)

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        with self.engine.lock, torch.inference_mode():
            decoder = self.engine.decoder()
            try:
                while not self._stop.is_set():
                    self._fill(decoder)
                    if decoder.rows:
                        self._step(decoder)
            finally:
                decoder.close()

    def _room(self, decoder: Decoder) -> int:
        most = self.max_batch if decoder.most_rows is None else min(self.max_batch, decoder.most_rows)
        return most - len(decoder.rows) - len(self._traces)

    def _fill(self, decoder: Decoder) -> None:
        """Let queued jobs join, then run the trace jobs taken in."""
        try:
            self._take_in(decoder)
        finally:
            traces, self._traces = self._traces, []
            if traces:
                self._run_traces(decoder, traces)

    def _take_in(self, decoder: Decoder) -> None:
        """Let queued jobs join; when nothing runs, wait for one (then `wait_s` for company). Trace
        jobs count against `max_batch` here too, so at most a batch of them is taken in at once."""
        if not decoder.rows:
            try:
                first = self.inbox.get(timeout=0.5)  # wakes only to notice `stop`
            except queue.Empty:
                return
            self._join(decoder, first)
            deadline = time.monotonic() + self.wait_s
            while self._room(decoder) > 0 and (left := deadline - time.monotonic()) > 0:
                try:
                    self._join(decoder, self.inbox.get(timeout=left))
                except queue.Empty:
                    break
        while self._room(decoder) > 0:
            try:
                entry = self.inbox.get_nowait()
            except queue.Empty:
                return
            if not self._join(decoder, entry):
                return

    def _join(self, decoder: Decoder, entry: Entry) -> bool:
        """Prefill `entry` into the batch; False when it must wait for room (memory budget). A
        trace job waits in `_traces` for the trace pass at the end of `_fill`."""
        try:
            seq = entry.prepare()
        except Exception as exc:  # noqa: BLE001 - the job's failure, handed back
            entry.done(exc)
            return True
        if seq.trace:
            self._traces.append((entry, seq))
            return True
        cost = entry.estimate(seq)
        used = sum(c for _, c in self._active.values())
        if decoder.rows and self.budget and used + cost > self.budget:
            self._requeue(entry, seq)
            return False
        try:
            decoder.admit(seq)
        except Exception as exc:  # noqa: BLE001 - a prefill that fails ends this job only
            entry.done(OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc)
            return True
        self.stats.add(0, 1)  # its first token came from the prefill
        if seq.ended is not None:
            entry.done(seq)
        else:
            self._active[id(seq)] = (entry, cost)
        return True

    def _run_traces(self, decoder: Decoder, traces: list[tuple[Entry, Sequence]]) -> None:
        """The trace jobs in passes of similar lengths: sorted, and a pass ends before padding
        would exceed TRACE_PADDING of its positions (padding is computed and thrown away: on a
        CPU, where a batch computes no faster per position, it is pure loss) or its padded size
        the memory budget (a job alone always runs)."""
        traces.sort(key=lambda item: item[1].prompt_tokens)
        group: list[tuple[Entry, Sequence]] = []
        for item in traces:
            padded = item[1].prompt_tokens  # sorted: the newest is the longest
            cost = sum(self.engine.trace_cost(seq, padded) for _, seq in [*group, item])
            positions = padded * (len(group) + 1)
            real = padded + sum(seq.prompt_tokens for _, seq in group)
            if group and (positions - real > TRACE_PADDING * positions or (self.budget and cost > self.budget)):
                self._trace_pass(decoder, group)
                group = []
            group.append(item)
        if group:
            self._trace_pass(decoder, group)

    def _trace_pass(self, decoder: Decoder, group: list[tuple[Entry, Sequence]]) -> None:
        """One forward pass over `group`; out of memory, it runs in halves, down to one job, which
        then fails alone."""
        seqs = [seq for _, seq in group]
        marks = [seq.capture.mark() if seq.capture else None for seq in seqs]
        try:
            decoder.trace(seqs)
        except Exception as exc:
            if is_oom(exc) and len(group) > 1:
                for seq, mark in zip(seqs, marks, strict=True):
                    if seq.capture is not None and mark is not None:
                        seq.capture.reset(mark)
                    if seq.scores is not None:
                        seq.scores = type(seq.scores)(seq.scores.k)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                half = len(group) // 2
                self._trace_pass(decoder, group[:half])
                self._trace_pass(decoder, group[half:])
                return
            failure: Exception = OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc
            if not is_oom(exc):
                log.exception("a trace pass failed; failing the %d jobs in it", len(group))
            for entry, _ in group:
                entry.done(failure)
            return
        self.stats.add(len(group), 0)
        for entry, seq in group:
            entry.done(seq)

    def _requeue(self, entry: Entry, seq: Sequence) -> None:
        """Over budget: back to the head of the line with its sequence already prepared."""
        prepared = Entry(prepare=lambda: seq, done=entry.done, estimate=entry.estimate, joined=entry.joined)
        with self.inbox.mutex:
            self.inbox.queue.appendleft(prepared)
            self.inbox.not_empty.notify()

    def _step(self, decoder: Decoder) -> None:
        size = len(decoder.rows)
        try:
            ended = decoder.step()
        except Exception as exc:
            log.exception("a decoding step failed; failing the %d jobs in it", size)
            failure: Exception = OutOfMemory(OUT_OF_MEMORY) if is_oom(exc) else exc
            for seq in decoder.rows:
                entry, _ = self._active.pop(id(seq))
                entry.done(failure)
            decoder.rows.clear()
            decoder.cache = None
            return
        self.stats.add(size, size)
        for seq in ended:
            entry, _ = self._active.pop(id(seq))
            entry.done(seq)

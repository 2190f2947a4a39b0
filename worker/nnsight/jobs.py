"""Trusted nnsight code on the served model: an nnsight job's payload (what nnsight 0.8's client
sends with `remote=True`: cloudpickle of a trace's code and the values it uses) is unpickled
and run here, on the engine thread, between two decoding steps of the running batch.

THIS RUNS THE SENDER'S CODE AS THE WORKER. Only keys in ACTQ_NNSIGHT_KEYS reach it (the API
refuses every other key before anything is stored); this module is the one place in actq that
unpickles anything (docs/nnsight.md, docs/reliability.md).

A run, as NDIF's own server does it: wrap the model the worker holds (nnsight's
`TransformersModel` around the same module object: no copy of the weights), unpickle the
payload against it, execute the trace at depth one, keep the values it saved. Then undo it all:
nnsight's controllers leave the modules, the guard (worker/nnsight/guard.py) puts back anything
else the code changed and reads written weights again from the model's files, and nnsight's
code caches are restored, so the running batch goes on exactly as before. `print` inside the
trace reaches the client as LOG statuses. A wall-clock limit interrupts the code (an exception
raised in the engine thread); code that will not stop is ended with its engine by the worker's
hard limit (ACTQ_JOB_TIME_LIMIT).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shared.errors import JobFailure, JobTimeout, NnsightCodeFailed, OutOfMemory, WeightsWritten
from worker.model.loading import installed_version
from worker.rules.failures import is_oom

if TYPE_CHECKING:
    from worker.batch.served import ServedModel

log = logging.getLogger(__name__)
MAX_LOG_LINE = 4000  # characters of one printed line sent as a LOG status
MAX_LOG_LINES = 1000  # LOG statuses per job; what is printed past this is dropped (and said)
STRAY_BYTES = 1 << 20  # characters printed outside any job (by threads a job left) that reach the log
# What nnsight itself puts on each module it wraps (its controller as the instance's forward, its
# state): taken off again after every job, not reported.
NNSIGHT_ATTRIBUTES = frozenset({"forward", "__nnsight__"})
# What nnsight's wrapping sets on the tokenizer (left padding for a causal model, EOS as the pad
# token where there is none): put back after every job, not reported.
NNSIGHT_TOKENIZER_ATTRIBUTES = frozenset({"padding_side", "_special_tokens_map"})


@dataclass
class Outcome:
    """What a run saved (names to values, as nnsight's client pushes them into its frame) and
    what the guard had to put back besides nnsight's own wrapping."""

    saves: dict[str, Any]
    restored: list[str]
    held_s: float  # how long the job had the model to itself: the running batch's pause
    # What the job changed that the guard could not put back or prove as before (the engine must
    # be replaced before it serves anyone); a failure raised by `run` carries it too (`.unproven`).
    unproven: list[str] = field(default_factory=list)


# -- printing inside a trace --------------------------------------------------------------


class _ThreadStdout(io.TextIOBase):
    """sys.stdout that sends what a job prints to that job's sink: what its own thread prints, and,
    while it runs, what any other thread without a sink prints (threads its code started). What
    such threads print while no job runs reaches the process's own stdout up to STRAY_BYTES in
    all, then is dropped (said once): a job's thread left printing filled a worker's log with 200 MB."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.sinks: dict[int, _LineSink] = {}
        self.current: _LineSink | None = None  # the running job's sink (exclusive runs: one at a time)
        self.stray = 0  # characters passed to `original` from threads without a sink, no job running

    def write(self, text: str) -> int:
        sink = self.sinks.get(threading.get_ident()) or self.current
        if sink is not None:
            sink.write(text)
        elif self.stray < STRAY_BYTES:
            self.stray += len(text)
            self.original.write(text[: max(0, len(text) - (self.stray - STRAY_BYTES))])
            if self.stray >= STRAY_BYTES:
                dropped = f"more than {STRAY_BYTES} characters printed outside any job; the rest are dropped"
                self.original.write(f"\n(actq: {dropped})\n")
        return len(text)

    def flush(self) -> None:
        if threading.get_ident() not in self.sinks:
            self.original.flush()


class _LineSink:
    """Lines of printed text, each emitted once whole (cut at MAX_LOG_LINE characters): a line's
    text past the cut is never kept, so printing without newlines costs linear time and bounded
    memory. Several threads may write."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit, self.lines = emit, 0
        self.pending: list[str] = []  # the line so far, at most MAX_LOG_LINE characters
        self.size = 0
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            start = 0
            while (end := text.find("\n", start)) >= 0:
                self._keep(text, start, end)
                self._line()
                start = end + 1
            self._keep(text, start, len(text))

    def _keep(self, text: str, start: int, end: int) -> None:
        room = MAX_LOG_LINE - self.size
        if room > 0 and end > start:
            part = text[start : min(end, start + room)]
            self.pending.append(part)
            self.size += len(part)

    def close(self) -> None:
        with self.lock:
            if self.pending:
                self._line()

    def _line(self) -> None:
        line, self.pending, self.size = "".join(self.pending), [], 0
        self.lines += 1
        if self.lines <= MAX_LOG_LINES:
            self.emit(line)
        elif self.lines == MAX_LOG_LINES + 1:
            self.emit(f"(actq: more than {MAX_LOG_LINES} lines printed; the rest are dropped)")


_stdout_lock = threading.Lock()


def _router() -> _ThreadStdout:
    """sys.stdout as actq's router (installed once: the guard notes it as the process's own)."""
    with _stdout_lock:
        if not isinstance(sys.stdout, _ThreadStdout):
            sys.stdout = _ThreadStdout(sys.stdout)
        return sys.stdout


@contextlib.contextmanager
def _printed_to(emit: Callable[[str], None]) -> Iterator[None]:
    router = _router()
    sink = _LineSink(emit)
    router.sinks[threading.get_ident()] = sink
    router.current = sink
    try:
        yield
    finally:
        router.sinks.pop(threading.get_ident(), None)
        router.current = None
        sink.close()


# -- the wall-clock limit --------------------------------------------------------------------


class _Interrupted(BaseException):
    """Raised in the engine thread when the job's time is up (BaseException: past `except Exception`)."""


@contextlib.contextmanager
def _interrupt_after(seconds: float) -> Iterator[None]:
    """Raise _Interrupted in this thread after `seconds`, unless the block ended first. The end
    and the interrupt take one lock, and the end clears one set but not yet raised."""
    thread = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    over = False

    def fire() -> None:
        with lock:
            if not over:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, ctypes.py_object(_Interrupted))

    timer = threading.Timer(seconds, fire)
    timer.name = "actq-nnsight-time-limit"  # actq's own: the guard does not count it as the code's
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            over = True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(thread, None)
        timer.cancel()


# -- running a payload ---------------------------------------------------------------------


def _unwrapped(served: ServedModel) -> Callable[[], dict[str, torch.Tensor]]:
    """What the guard reads written weights again from: the model's own files (its parameters
    and persistent buffers; the guard keeps its own copy of the non-persistent ones)."""

    def reload() -> dict[str, torch.Tensor]:
        fresh = type(served.hf).from_pretrained(served.loaded.source, dtype=served.hf.dtype)
        return fresh.state_dict()

    return reload


def run(served: ServedModel, blob: bytes, compress: bool, limit: float, emit: Callable[[str], None]) -> Outcome:
    """Run one payload on `served`'s model (on the engine thread, the batch paused). Raises the
    job's failure: its traceback, a timeout, out of memory, weights written. The outcome, or the
    failure raised, has `unproven`: what the guard found changed and could not prove put back."""
    from nnsight.intervention.serialization import UnknownPersistentIdError
    from nnsight.modeling.transformers import TransformersModel
    from nnsight.schema.request import RequestModel
    from nnsight.tracing import globals as nnsight_globals
    from nnsight.tracing.tracer import _saves, dec, inc

    from worker.nnsight.guard import ModelGuard

    began = time.perf_counter()
    _router()  # before the guard notes sys.stdout: the router is actq's, not the code's
    try:
        guard = ModelGuard(
            served.hf,
            _unwrapped(served),
            expected=NNSIGHT_ATTRIBUTES,
            tokenizer=served.tokenizer,
            tokenizer_expected=NNSIGHT_TOKENIZER_ATTRIBUTES,
        )
    except BaseException as exc:  # the code has not run: nothing of it to prove
        exc.unproven = []  # type: ignore[attr-defined]
        raise
    recursion_limit = guard.settings.recursion_limit
    caches = (dict(nnsight_globals.SOURCES), dict(nnsight_globals.BLOCKS))
    import linecache

    lines = dict(linecache.cache)
    failure: BaseException | None = None
    saves: dict[str, Any] = {}
    wrapped = None
    try:
        with torch.inference_mode(False), torch.enable_grad(), _printed_to(emit), _interrupt_after(limit):
            try:
                wrapped = TransformersModel(served.hf, task="text-generation", tokenizer=served.tokenizer)
                persistent = wrapped._remoteable_persistent_objects()
                try:
                    tracer = RequestModel.deserialize(blob, persistent, compress=compress)
                except UnknownPersistentIdError as exc:
                    pid = str(exc.args[0]) if exc.args else str(exc)
                    raise NnsightCodeFailed(_missing(pid, served)) from None
                inc()
                try:
                    tracer.execute(tracer.info.code)
                    marked = _saves()
                    saves = {k: v for k, v in tracer.info.frame.f_locals.items() if id(v) in marked}
                finally:
                    sys.setrecursionlimit(recursion_limit)  # see below
                    dec()
            finally:
                # First, before any other call: a limit the code lowered (sys.setrecursionlimit(30)
                # from a thread of its own) makes every call deeper than it fail, nnsight's `dec`, the
                # timer's cancel and the guard's included. This frame is shallow on the engine thread;
                # a limit below even this depth ends the engine, and the worker starts a new one.
                sys.setrecursionlimit(recursion_limit)
    except _Interrupted:
        failure = JobTimeout(f"the nnsight job ran past its time limit of {limit:g}s (ACTQ_NNSIGHT_TIME_LIMIT)")
    except JobFailure as exc:
        failure = exc
    except BaseException as exc:  # noqa: BLE001 - the sender's code: anything it raises is its job's error
        if is_oom(exc):
            failure = OutOfMemory(
                f"the nnsight job ran out of memory ({type(exc).__name__}: {str(exc)[:300]}); the engine and the "
                "other jobs go on: run on fewer or shorter inputs, or save less"
            )
        else:
            failure = NnsightCodeFailed(_traceback(exc))
    finally:
        if wrapped is not None:
            with contextlib.suppress(Exception):
                wrapped.interleaver.cancel()
        nnsight_globals.SOURCES.clear()
        nnsight_globals.SOURCES.update(caches[0])
        nnsight_globals.BLOCKS.clear()
        nnsight_globals.BLOCKS.update(caches[1])
        linecache.cache.clear()
        linecache.cache.update(lines)
        del wrapped
        restored = guard.restore()
        if failure is not None:
            saves = {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if restored.unproven:
        log.warning("the nnsight job left changes the guard could not put back: %s", "; ".join(restored.unproven))
    if restored.weights_written:
        shown = ", ".join(restored.weights[:5]) + (" ..." if len(restored.weights) > 5 else "")
        failure = WeightsWritten(
            f"the nnsight job wrote to the model's weights ({shown}); its result is discarded and the worker read "
            "the weights again from the model's files. Edit a copy of a weight, or use `model.edit()` / "
            "activation edits, which leave the weights alone"
        )
    if failure is not None:
        failure.unproven = list(restored.unproven)  # type: ignore[attr-defined]
        raise failure
    return Outcome(saves, restored.state, time.perf_counter() - began, list(restored.unproven))


def _missing(pid: str, served: ServedModel) -> str:
    if pid.startswith("Module:"):
        envoy = pid.removeprefix("Module:")  # nnsight's path: the root envoy is `model`
        path = "" if envoy == "model" else envoy.removeprefix("model.")
        return (
            f"the payload uses module {path or '(the root)'!r}, which the served model {served.info.name} "
            f"({served.info.architecture}) does not have: build the client's model from the same checkpoint "
            '(docs/nnsight.md, "Your own nnsight code")'
        )
    return f"the payload refers to {pid!r}, which this worker cannot provide (nnsight {installed_version('nnsight')})"


def _traceback(exc: BaseException) -> str:
    """The sender's traceback, nnsight's and actq's own frames left out where nnsight can."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"the nnsight code raised {type(exc).__name__}: {exc}\n{text[-8000:]}"


def save_result(saves: dict[str, Any], compress: bool) -> bytes:
    """The saves as nnsight's client reads them: `torch.save`, zstd-compressed if it asked."""
    buffer = io.BytesIO()
    torch.save(saves, buffer)
    data = buffer.getvalue()
    if compress:
        import zstandard

        data = zstandard.ZstdCompressor(level=3).compress(data)
    return data

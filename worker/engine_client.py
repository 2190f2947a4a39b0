"""The Celery worker's side of an engine process (worker/engine/process.py): start it, hand it job ids,
and wait for each job to end. Each task thread waits for its own job, so each message is acked
when its own job ends; the worker's main thread never computes and stays free for control
commands, heartbeats and events.

A worker holds one client per engine role: `capture` (every job but nnsight ones, started with
the worker) and, with ACTQ_NNSIGHT_ENGINE=own, `nnsight` (trusted code, on a model copy of its
own; started at the first nnsight job, stopped when idle: `lazy`).

When an engine process ends, each job it held is answered by who is to blame:
- `killed`: the job that was running alone (trusted code) when its engine died, or that its
  engine was stopped for (its hard time limit: `timeout`). It is not run again.
- `requeue`: the others, when the death has such a culprit, or the engine said it must be
  replaced (trusted code left it in a state it could not prove whole): they go back to the
  queue and the delivery is not counted against them.
- `lost`: every job, when nothing explains the death (kill -9 from outside, the kernel's OOM
  killer during a batch): back to the queue, the next delivery counts as an attempt.
A capture engine that died is started again at once; a lazy one at its next job. Why it died
(its `dead` message, else its exit status) goes to the worker's log and, through `ended`, to each
job it held: a job lost on its last allowed attempt is failed with that reason (worker/celery_app.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.process import NODE_ENV, REPLY_FD_ENV, ROLE_ENV
from worker.rules.failures import exit_status

EX_FAILURE = 1
RESTARTS = 3  # tries to replace a dead engine before the worker gives up
log = logging.getLogger("actq.worker")


class EngineStartFailed(RuntimeError):
    pass


@dataclass
class _Waiter:
    event: threading.Event = field(default_factory=threading.Event)
    outcome: str = ""
    started: float | None = None
    limit: float | None = None  # the job's own hard limit, when shorter than the worker's
    alone: bool = False  # it runs with the model to itself (trusted code): its engine's death is its own
    storing: bool = False  # it left its batch; its files and outcome are being written (counted in `on_storing`)
    attempt: tuple[int, str | None] | None = None  # the claim it runs as (number, worker: shared/attempts.py)


@dataclass
class _Engine:
    """One engine process and what it said before it ended."""

    proc: subprocess.Popen
    generation: int
    replace: list[str] = field(default_factory=list)  # why it asked to be replaced, if it did
    dead: str | None = None  # why it ended, as it said before it did (its `dead` message), if it said
    culprit: str | None = None  # the job it was stopped for (hard time limit)


class EngineClient:
    def __init__(
        self,
        start_timeout: float,
        role: str = "capture",
        lazy: bool = False,
        idle_seconds: float | None = None,
        on_storing: Callable[[int], None] = lambda _: None,
    ) -> None:
        """`on_storing(+1)` when a job the engine holds has left its batch and only writing its
        files and outcome remain, `on_storing(-1)` when that job ends (however it ends): what
        worker/storing_room.py counts."""
        self.start_timeout, self.role, self.lazy, self.idle_seconds = start_timeout, role, lazy, idle_seconds
        self.on_storing = on_storing
        self.node: str | None = None  # the worker's Celery node name: the engine's name in Redis
        self.engine: _Engine | None = None
        self._lock = threading.Lock()  # guards engine, _waiting and writes to the engine's stdin
        self._starting = threading.Lock()  # one start at a time
        self._waiting: dict[str, _Waiter] = {}
        self._closing = False
        self._generation = 0  # which engine process a reader thread belongs to
        self._up = threading.Event()  # an engine process is ready for jobs
        self._last_use = time.monotonic()
        # job id -> the hard limit it was stopped at and the attempt it ran as (read once)
        self.stopped_at: dict[str, tuple[float, tuple[int, str | None] | None]] = {}
        # job id -> how the engine that held it ended (or why none could start), and its attempt (read once)
        self.ended: dict[str, tuple[str, tuple[int, str | None] | None]] = {}
        # job id -> the attempt an engine's death sent back to the queue ran as (read once)
        self.requeued: dict[str, tuple[int, str | None] | None] = {}
        if lazy and idle_seconds:
            threading.Thread(target=self._idle_stop, name=f"actq-{role}-idle", daemon=True).start()

    @property
    def proc(self) -> subprocess.Popen | None:
        engine = self.engine
        return engine.proc if engine is not None else None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start an engine process and wait until its model is loaded (or raise why not)."""
        read_fd, write_fd = os.pipe()
        env = {**os.environ, REPLY_FD_ENV: str(write_fd), ROLE_ENV: self.role}
        if self.node:
            env[NODE_ENV] = self.node
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.engine.process"],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            text=True,
        )
        os.close(write_fd)
        replies = os.fdopen(read_fd, "r", encoding="utf-8")
        ready = threading.Event()
        with self._lock:
            self._generation += 1
            engine = _Engine(proc, self._generation)
            self.engine = engine
        reader = threading.Thread(
            target=self._read, args=(engine, replies, ready), name=f"actq-{self.role}-replies", daemon=True
        )
        reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not ready.wait(0.2):
            if proc.poll() is not None:
                reader.join(timeout=5)  # until it has read what the process said before it ended
                raise EngineStartFailed(
                    f"the {self.role} engine process ended ({_how(engine)}) while loading the model"
                )
            if time.monotonic() > deadline:
                proc.kill()
                raise EngineStartFailed(f"the model did not load within {self.start_timeout:g}s")
        self._up.set()
        log.info("%s engine process %d ready", self.role, proc.pid)

    def _ensure_started(self) -> str | None:
        """A lazy engine: start it if none runs. None when one is up, else why it could not start."""
        with self._starting:
            if self._up.is_set() or self._closing:
                return None
            try:
                self.start()
            except EngineStartFailed as exc:
                log.error("the %s engine could not start: %s", self.role, exc)
                return str(exc)
        return None

    def closing(self) -> None:
        """The worker is stopping: an engine that ends from now on is not restarted, and one that
        runs on (finishing its jobs) stops its heartbeat: it takes no new job."""
        with self._lock:
            self._closing = True
            proc = self.proc
            if proc is not None and proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(json.dumps({"closing": True}) + "\n")
                    proc.stdin.flush()
                except OSError:  # it is ending already
                    pass

    def close(self) -> None:
        """Stop the engine: closing its stdin lets it unpublish itself and exit."""
        with self._lock:
            self._closing = True
            proc = self.proc
        if proc is not None:
            _stop(proc)

    def _idle_stop(self) -> None:
        """A lazy engine with no job for `idle_seconds` is stopped (its copy of the model freed)."""
        assert self.idle_seconds is not None
        while True:
            time.sleep(min(self.idle_seconds / 4, 30.0))
            with self._starting, self._lock:
                engine = self.engine
                idle = time.monotonic() - self._last_use >= self.idle_seconds
                if engine is None or self._waiting or not idle or not self._up.is_set():
                    continue
                self._up.clear()
                self.engine = None
                self._generation += 1  # its reader's end is not a death
            log.info("the %s engine had no job for %gs: stopping it", self.role, self.idle_seconds)
            _stop(engine.proc)

    # -- jobs ----------------------------------------------------------------------------

    def run(self, job_id: str, time_limit: float) -> str:
        """Hand `job_id` to the engine and wait: "done" (its outcome is recorded), "redis" (Redis
        was unreachable: nothing recorded), "lost" / "requeue" / "killed" (its engine died: see the
        module's docstring; `ended` then says how the engine ended), "timeout" (the engine kept it past
        `time_limit` seconds from joining a batch, or past the job's own shorter limit; `stopped_at`
        then holds that limit and the attempt the engine ran it as; the engine has been stopped) or
        "unavailable" (a lazy engine could not start; `ended` says why)."""
        waiter = _Waiter()
        if self.lazy:
            with self._lock:
                self._last_use = time.monotonic()
            why = self._ensure_started()
            if why is not None:
                self.ended[job_id] = (why, None)
                return "unavailable"
        self._up.wait()  # while a dead engine is being replaced
        with self._lock:
            engine = self.engine
            proc = engine.proc if engine is not None else None
            if engine is None or proc is None or proc.poll() is not None or proc.stdin is None:
                return "lost"
            self._waiting[job_id] = waiter
            try:
                proc.stdin.write(json.dumps({"run": job_id}) + "\n")
                proc.stdin.flush()
            except OSError:
                self._waiting.pop(job_id, None)
                return "lost"
        try:
            while not waiter.event.wait(0.5):
                limit = time_limit if waiter.limit is None else min(time_limit, waiter.limit)
                if waiter.started is not None and time.monotonic() - waiter.started > limit:
                    with self._lock:
                        self._waiting.pop(job_id, None)
                        self.stopped_at[job_id] = (limit, waiter.attempt)
                        engine.culprit = job_id
                    log.error("job %s did not end %gs after it started: stopping its engine", job_id, limit)
                    _kill(proc)
                    return "timeout"
            return waiter.outcome
        finally:
            with self._lock:
                self._last_use = time.monotonic()
                self._waiting.pop(job_id, None)  # a `storing` read from now on finds no waiter
                if waiter.storing:
                    waiter.storing = False
                    self.on_storing(-1)

    def _read(self, engine: _Engine, replies, ready: threading.Event) -> None:
        for line in replies:
            message = json.loads(line)
            if "ready" in message:
                ready.set()
            elif "started" in message:
                with self._lock:
                    waiter = self._waiting.get(message["started"])
                if waiter is not None:
                    waiter.limit = message.get("limit")
                    waiter.alone = bool(message.get("alone"))
                    attempt = message.get("attempt")
                    waiter.attempt = (int(attempt[0]), attempt[1]) if attempt else None
                    waiter.started = time.monotonic()
            elif "storing" in message:
                with self._lock:
                    waiter = self._waiting.get(message["storing"])
                    if waiter is not None and not waiter.storing:
                        waiter.storing = True
                        self.on_storing(1)
            elif "done" in message:
                with self._lock:
                    waiter = self._waiting.pop(message["done"], None)
                if waiter is not None:
                    waiter.outcome = message["outcome"]
                    waiter.event.set()
            elif "replace" in message:
                engine.replace = [str(r) for r in message["replace"]] or ["(no reason given)"]
            elif "dead" in message:
                engine.dead = str(message["dead"])
        engine.proc.wait()
        self._engine_ended(engine, ready.is_set())

    def _engine_ended(self, engine: _Engine, was_ready: bool) -> None:
        with self._lock:
            if engine.generation != self._generation:
                return
            held, self._waiting = self._waiting, {}
            closing = self._closing
            self._up.clear()
            if self.lazy:
                self.engine = None
        how = _how(engine)
        blamed = [job for job, w in held.items() if w.alone and w.started is not None]
        innocent = bool(engine.replace or engine.culprit or blamed)
        for job_id, waiter in held.items():
            self.ended[job_id] = (how, waiter.attempt)
            if job_id in blamed:
                waiter.outcome = "killed"
            else:
                waiter.outcome = "requeue" if innocent else "lost"
                if innocent:
                    self.requeued[job_id] = waiter.attempt
            waiter.event.set()
        if closing or not was_ready:
            return
        if engine.replace:
            log.warning(
                "the %s engine process %d was replaced (%s); %d jobs go back to the queue, not counted against them",
                self.role,
                engine.proc.pid,
                "; ".join(engine.replace)[:500],
                len(held),
            )
        else:
            log.error(
                "the %s engine process %d ended (%s); %s; %d jobs go back to the queue%s",
                self.role,
                engine.proc.pid,
                how,
                f"blamed on job {', '.join(blamed)} (trusted code running alone)" if blamed else "no job to blame",
                len(held) - len(blamed),
                ", not counted against them" if innocent else "",
            )
        if self.lazy:
            return  # started again by its next job
        for attempt in range(1, RESTARTS + 1):
            try:
                self.start()
                return
            except EngineStartFailed:
                log.error("engine restart %d of %d failed", attempt, RESTARTS, exc_info=True)
        # A worker that cannot hold its model must not take jobs: exit at once with a failure code
        # (the messages it holds are redelivered after the visibility timeout). Celery's own cold
        # shutdown cannot be used: it tries to kill each running task, which a threads pool cannot.
        log.critical("cannot restart the engine; stopping the worker")
        os._exit(EX_FAILURE)


def _how(engine: _Engine) -> str:
    """How an engine process ended: its exit status, and why as it said (its `dead` message)."""
    return exit_status(engine.proc.returncode) + (f": {engine.dead}" if engine.dead else "")


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.send_signal(signal.SIGKILL)
    except OSError:
        pass


def _stop(proc: subprocess.Popen) -> None:
    """Close the engine's stdin (it unpublishes itself and exits); kill it if it lingers."""
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()

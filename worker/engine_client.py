"""The Celery worker's side of the engine process (engine_process.py): start it, hand it job ids,
and wait for each job to end. Each task thread waits for its own job, so each message is acked
when its own job ends; the worker's main thread never computes and stays free for control
commands, heartbeats and events.

If the engine process dies (kill -9, the kernel's OOM killer), every job it held is answered
`lost` (its task rejects the message back to the queue, and the next attempt counts) and a new
engine process is started. A job that has not ended `job_time_limit` seconds after it joined a
batch means a stuck engine: that job is failed as a timeout and the engine restarted.
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
from dataclasses import dataclass, field

from worker.engine_process import REPLY_FD_ENV

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
    attempt: tuple[int, str | None] | None = None  # the claim it runs as (number, worker)


class EngineClient:
    def __init__(self, start_timeout: float) -> None:
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # guards proc, _waiting and writes to the engine's stdin
        self._waiting: dict[str, _Waiter] = {}
        self._closing = False
        self._generation = 0  # which engine process a reader thread belongs to
        self._up = threading.Event()  # an engine process is ready for jobs
        # job id -> the hard limit it was stopped at and the attempt it ran as (read once)
        self.stopped_at: dict[str, tuple[float, tuple[int, str | None] | None]] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start an engine process and wait until its model is loaded (or raise why not)."""
        read_fd, write_fd = os.pipe()
        env = {**os.environ, REPLY_FD_ENV: str(write_fd)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.engine_process"],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            text=True,
        )
        os.close(write_fd)
        replies = os.fdopen(read_fd, "r", encoding="utf-8")
        ready = threading.Event()
        with self._lock:
            self.proc = proc
            self._generation += 1
            generation = self._generation
        reader = threading.Thread(
            target=self._read, args=(proc, replies, ready, generation), name="actq-engine-replies", daemon=True
        )
        reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not ready.wait(0.2):
            if proc.poll() is not None:
                raise EngineStartFailed(f"the engine process exited with {proc.returncode} while loading the model")
            if time.monotonic() > deadline:
                proc.kill()
                raise EngineStartFailed(f"the model did not load within {self.start_timeout:g}s")
        self._up.set()
        log.info("engine process %d ready", proc.pid)

    def closing(self) -> None:
        """The worker is stopping: an engine that ends from now on is not restarted."""
        with self._lock:
            self._closing = True

    def close(self) -> None:
        """Stop the engine: closing its stdin lets it unpublish itself and exit."""
        with self._lock:
            self._closing = True
            proc = self.proc
        if proc is None:
            return
        try:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()

    # -- jobs ----------------------------------------------------------------------------

    def run(self, job_id: str, time_limit: float) -> str:
        """Hand `job_id` to the engine and wait: "done" (its outcome is recorded), "redis" (Redis
        was unreachable: nothing recorded), "lost" (the engine died) or "timeout" (the engine
        kept it past `time_limit` seconds from joining a batch, or past the job's own shorter
        limit; `stopped_at` then holds that limit and the attempt the engine ran it as; it has been
        restarted)."""
        waiter = _Waiter()
        self._up.wait()  # while a dead engine is being replaced
        with self._lock:
            proc = self.proc
            if proc is None or proc.poll() is not None or proc.stdin is None:
                return "lost"
            self._waiting[job_id] = waiter
            try:
                proc.stdin.write(json.dumps({"run": job_id}) + "\n")
                proc.stdin.flush()
            except OSError:
                self._waiting.pop(job_id, None)
                return "lost"
        while not waiter.event.wait(0.5):
            limit = time_limit if waiter.limit is None else min(time_limit, waiter.limit)
            if waiter.started is not None and time.monotonic() - waiter.started > limit:
                with self._lock:
                    self._waiting.pop(job_id, None)
                    self.stopped_at[job_id] = (limit, waiter.attempt)
                log.error("job %s did not end %gs after it started: restarting the engine", job_id, limit)
                self._kill(proc)
                return "timeout"
        return waiter.outcome

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            proc.send_signal(signal.SIGKILL)
        except OSError:
            pass

    def _read(self, proc: subprocess.Popen, replies, ready: threading.Event, generation: int) -> None:
        for line in replies:
            message = json.loads(line)
            if "ready" in message:
                ready.set()
            elif "started" in message:
                with self._lock:
                    waiter = self._waiting.get(message["started"])
                if waiter is not None:
                    waiter.limit = message.get("limit")
                    attempt = message.get("attempt")
                    waiter.attempt = (int(attempt[0]), attempt[1]) if attempt else None
                    waiter.started = time.monotonic()
            elif "done" in message:
                with self._lock:
                    waiter = self._waiting.pop(message["done"], None)
                if waiter is not None:
                    waiter.outcome = message["outcome"]
                    waiter.event.set()
        proc.wait()
        self._engine_ended(proc, generation, ready.is_set())

    def _engine_ended(self, proc: subprocess.Popen, generation: int, was_ready: bool) -> None:
        with self._lock:
            if generation != self._generation:
                return
            lost, self._waiting = self._waiting, {}
            closing = self._closing
            self._up.clear()
        for waiter in lost.values():
            waiter.outcome = "lost"
            waiter.event.set()
        if closing or not was_ready:
            return
        log.error(
            "the engine process %d exited with %s; %d jobs go back to the queue; restarting it",
            proc.pid,
            proc.returncode,
            len(lost),
        )
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

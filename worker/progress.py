"""Running jobs' progress and cancel flags, kept off the engine thread.

The engine thread asks after every decoding step whether a job should stop (`Watch`); answering
from Redis there would put a network round trip (and, during an outage, seconds of retries) inside
the decoding loop of every job in the batch. Instead one thread of its own, every `interval`
seconds, writes the progress of every running job and reads all their cancel flags in one
pipelined round trip (`JobStore.report_progress_many`), and the engine thread reads what it last
saw: a dictionary lookup. A cancel is therefore seen within `interval` plus one step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from shared.jobs import JobStore

log = logging.getLogger(__name__)


@dataclass
class _Running:
    tokens: int = 0
    cancelled: bool = False


class ProgressWatch:
    def __init__(self, jobs: JobStore, interval: float) -> None:
        self.jobs, self.interval = jobs, interval
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="actq-progress", daemon=True)

    def start(self) -> ProgressWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def add(self, job_id: str) -> None:
        with self._lock:
            self._running[job_id] = _Running()

    def remove(self, job_id: str) -> None:
        with self._lock:
            self._running.pop(job_id, None)

    def update(self, job_id: str, tokens: int) -> bool:
        """From the engine thread: the job's tokens so far; True when a cancel was seen."""
        state = self._running.get(job_id)
        if state is None:
            return False
        state.tokens = tokens
        return state.cancelled

    def poll(self) -> None:
        """One round trip for every running job (the thread's loop; tests call it directly)."""
        with self._lock:
            running = {job_id: state.tokens for job_id, state in self._running.items()}
        if not running:
            return
        cancelled = self.jobs.report_progress_many(running)
        with self._lock:
            for job_id in cancelled:
                if job_id in self._running:
                    self._running[job_id].cancelled = True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            started = time.monotonic()
            try:
                self.poll()
            except redis.RedisError as exc:  # progress is best effort; cancels are seen once Redis is back
                log.warning("progress and cancel flags not read: %s", exc)
            except Exception:  # this thread must outlive any one bad round
                log.exception("progress round failed")
            spent = time.monotonic() - started
            if spent > self.interval * 10:
                log.warning("a progress round took %.2f s", spent)

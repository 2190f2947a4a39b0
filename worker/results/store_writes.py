"""Finishing the jobs whose outcome writes to the artifact store, apart from those that write
nothing (worker/engine/job_flow.py routes each finished job). A store that is slow or down (an S3 outage is
waited out for ACTQ_STORAGE_OUTAGE_SECONDS per upload) holds only the jobs that write to it: they
run on a pool of their own, one thread per job waiting, so a job that stores nothing is recorded
at once and none of these waits behind another's outage window.

Backpressure: once ACTQ_STORAGE_BACKLOG_BYTES bytes of captured activations (the jobs' buffers on
the host), or ACTQ_STORAGE_BACKLOG_JOBS jobs, wait to be stored, the next capture jobs wait before
joining a batch (logged with the reason), so their activations do not pile up in memory while the
store is away; the engine keeps decoding every other job. Held jobs join in order as soon as the
backlog is under both limits again (an upload succeeded, or failed past its outage window and its
job was failed with the store's error), as many as fit under them. A job larger than the bytes
limit on its own still joins once nothing else waits. The limits are wide enough for a healthy
store: a whole batch of small capture jobs ending at one step waits for its writes without
holding the next batch back (the old limit of 8 jobs did: bench/bench_bulk.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from celery.utils.log import get_task_logger

log = get_task_logger(__name__)
log.setLevel(logging.INFO)  # as worker/engine/job_flow.py: its lines reach the task log at Celery's default level
MIB = 1 << 20


@dataclass(frozen=True)
class Backlog:
    """What may wait to be stored before capture jobs are held: jobs and bytes."""

    jobs: int
    bytes: int

    def admits(self, jobs: int, nbytes: int, more: int) -> bool:
        """Whether a job of `more` bytes may join while `jobs` jobs of `nbytes` in all wait (or
        will: those let in by the same release): under both limits, or nothing waiting at all."""
        return jobs == 0 or (jobs < self.jobs and nbytes + more <= self.bytes)


class StoreWrites:
    def __init__(self, backlog: Backlog, threads: int) -> None:
        """`backlog`: what may wait before capture jobs are held; `threads`: at least the most jobs
        a worker has in flight (its ACTQ_MAX_BATCH), so none queues behind another."""
        self.limits = backlog
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="actq-store")
        self._lock = threading.Lock()
        self._waiting = 0  # jobs handed to the pool whose files are not yet stored (or failed)
        self._bytes = 0  # their captured bytes
        self._held: deque[tuple[str, Callable[[], None], int, float]] = deque()

    @property
    def backlog(self) -> int:
        return self._waiting

    @property
    def backlog_bytes(self) -> int:
        return self._bytes

    @property
    def held(self) -> int:
        return len(self._held)

    def submit(self, nbytes: int, finish: Callable[..., object], *args: object) -> None:
        """Run `finish(*args)` (it stores a job's files of `nbytes` captured bytes and records its
        outcome) on the pool."""
        with self._lock:
            self._waiting += 1
            self._bytes += nbytes

        def run() -> None:
            try:
                finish(*args)
            finally:
                self._stored(nbytes)

        self._pool.submit(run)

    def admit(self, job_id: str, join: Callable[[], None], nbytes: int) -> None:
        """`join()` (the capture job `job_id`, which will keep `nbytes`, joins a batch) now, or
        once the backlog is under its limits. Never blocks the caller."""
        with self._lock:
            hold = bool(self._held) or not self.limits.admits(self._waiting, self._bytes, nbytes)
            if hold:
                self._held.append((job_id, join, nbytes, time.monotonic()))
                waiting, waiting_bytes = self._waiting, self._bytes
        if not hold:
            join()
            return
        log.warning(
            "job %s waits to join a batch: the files of %d jobs are waiting to be stored (%.1f MiB; "
            "ACTQ_STORAGE_BACKLOG_JOBS=%d, ACTQ_STORAGE_BACKLOG_BYTES=%d); the artifact store is slow or unreachable",
            job_id,
            waiting,
            waiting_bytes / MIB,
            self.limits.jobs,
            self.limits.bytes,
        )

    def _stored(self, nbytes: int) -> None:
        with self._lock:
            self._waiting -= 1
            self._bytes -= nbytes
            # those let in now will wait to be stored in turn: counted, so one release stays under the limits
            jobs, taken, ready = self._waiting, self._bytes, []
            while self._held and self.limits.admits(jobs, taken, self._held[0][2]):
                ready.append(self._held.popleft())
                jobs, taken = jobs + 1, taken + ready[-1][2]
        for job_id, join, _, since in ready:
            waited = time.monotonic() - since
            log.info("job %s joins a batch after waiting %.1f s for the artifact store", job_id, waited)
            try:
                join()
            except Exception:  # this thread must go on to the next held job
                log.exception("job %s: joining a batch failed", job_id)

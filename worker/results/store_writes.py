"""Finishing the jobs whose outcome writes to the artifact store, apart from those that write
nothing (worker/engine/job_flow.py routes each finished job). A store that is slow or down (an S3 outage is
waited out for ACTQ_STORAGE_OUTAGE_SECONDS per upload) holds only the jobs that write to it: they
run on a pool of their own, one thread per job waiting, so a job that stores nothing is recorded
at once and none of these waits behind another's outage window.

Backpressure: once ACTQ_STORAGE_BACKLOG_JOBS jobs' files are waiting to be stored, the next
capture jobs wait before joining a batch (logged with the reason), so their activations do not
pile up in memory while the store is away; the engine keeps decoding every other job. Each held
job joins as soon as the backlog is under the limit again (an upload succeeded, or failed past
its outage window and its job was failed with the store's error)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from celery.utils.log import get_task_logger

log = get_task_logger(__name__)
log.setLevel(logging.INFO)  # as worker/engine/job_flow.py: its lines reach the task log at Celery's default level


class StoreWrites:
    def __init__(self, backlog_limit: int, threads: int) -> None:
        """`backlog_limit`: jobs whose files may wait before capture jobs are held; `threads`: at
        least the most jobs a worker has in flight (its ACTQ_MAX_BATCH), so none queues behind another."""
        self.backlog_limit = backlog_limit
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="actq-store")
        self._lock = threading.Lock()
        self._waiting = 0  # jobs handed to the pool whose files are not yet stored (or failed)
        self._held: deque[tuple[str, Callable[[], None], float]] = deque()

    @property
    def backlog(self) -> int:
        return self._waiting

    @property
    def held(self) -> int:
        return len(self._held)

    def submit(self, finish: Callable[..., object], *args: object) -> None:
        """Run `finish(*args)` (it stores a job's files and records its outcome) on the pool."""
        with self._lock:
            self._waiting += 1

        def run() -> None:
            try:
                finish(*args)
            finally:
                self._stored()

        self._pool.submit(run)

    def admit(self, job_id: str, join: Callable[[], None]) -> None:
        """`join()` (the capture job `job_id` joins a batch) now, or once fewer than the limit of
        jobs' files are waiting to be stored. Never blocks the caller."""
        with self._lock:
            hold = self._waiting >= self.backlog_limit or bool(self._held)
            if hold:
                self._held.append((job_id, join, time.monotonic()))
                waiting = self._waiting
        if not hold:
            join()
            return
        log.warning(
            "job %s waits to join a batch: the files of %d jobs are waiting to be stored "
            "(ACTQ_STORAGE_BACKLOG_JOBS=%d); the artifact store is slow or unreachable",
            job_id,
            waiting,
            self.backlog_limit,
        )

    def _stored(self) -> None:
        with self._lock:
            self._waiting -= 1
            room = self.backlog_limit - self._waiting
            ready = [self._held.popleft() for _ in range(min(max(room, 0), len(self._held)))]
        for job_id, join, since in ready:
            waited = time.monotonic() - since
            log.info("job %s joins a batch after waiting %.1f s for the artifact store", job_id, waited)
            try:
                join()
            except Exception:  # this thread must go on to the next held job
                log.exception("job %s: joining a batch failed", job_id)

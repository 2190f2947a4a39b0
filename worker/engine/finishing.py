"""Where a finished job's outcome is recorded (worker/engine/job_flow.py hands each one here): on
the store's own pool when finishing it writes files (worker/results/store_writes.py: a slow or
unreachable store holds only those jobs, and its backlog holds capture jobs back), else on two
finisher threads; and what a job's store write holds in memory until it is done."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shared.attempts import Attempt
from shared.schemas import JobRecord
from shared.settings import Settings
from worker.results.store_writes import Backlog, StoreWrites

if TYPE_CHECKING:
    from worker.batch.sequence import Sequence

finisher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="actq-finish")  # jobs that store nothing
_store_pools: list[StoreWrites] = []  # the jobs that write files (built at first use, from the settings)
_store_pool_lock = threading.Lock()


def store_pool(settings: Settings) -> StoreWrites:
    """The pool that finishes jobs whose outcome writes to the store (one per engine process)."""
    with _store_pool_lock:
        if not _store_pools:
            backlog = Backlog(settings.storage_backlog_jobs, settings.storage_backlog_bytes)
            _store_pools.append(StoreWrites(backlog, threads=max(settings.max_batch, 2)))
        return _store_pools[0]


def captured(run: Sequence | Exception | None) -> int:
    """The host bytes a run's capture keeps (its buffers, allocated when it was prepared); 0 for
    a run that failed before it had one."""
    capture = getattr(run, "capture", None)
    return capture.nbytes if capture is not None else 0


def captured_bytes(holder: dict[str, Any]) -> int:
    """What a finished job's runs captured: what its store write holds in memory until it is stored."""
    return captured(holder["outcome"]) + captured(holder.get("baseline"))


def writes_files(settings: Settings, holder: dict[str, Any]) -> bool:
    """Whether finishing this job touches the artifact store: its activations or log-probabilities
    past the inline limit, an nnsight job's saves, or earlier attempts' folders to remove."""
    record: JobRecord | None = holder.get("record")
    if record is None:  # never claimed: only Redis is told
        return False
    if record.request.nnsight is not None or Attempt.of(record).number > 1:
        return True
    runs = [holder["outcome"], holder.get("baseline")]
    if any(isinstance(run, BaseException) or (run is not None and run.failure is not None) for run in runs):
        return False  # a failed first attempt has written nothing
    if holder["outcome"].stopped_by is not None:  # cancelled or out of time: its partial result only
        return False
    if record.capture_points:
        return True
    limit = settings.logprobs_inline_tokens
    return any(run is not None and run.scores is not None and len(run.scores.values) > limit for run in runs)

"""The job store: JobRecords as JSON in Redis, with state changes that cannot race."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import redis
import stamina

from shared import keys, stats
from shared.schemas import JobError, JobRecord, JobStatus


def now() -> datetime:
    return datetime.now(UTC)


def _record_stats(pipe, record: JobRecord) -> None:
    """A job just ended: its figures go into the model's counters and histograms (same MULTI)."""
    counters = keys.counters(record.model)
    pipe.hincrby(counters, record.status.value, 1)
    if record.result is not None:
        pipe.hincrby(counters, "generated_tokens", record.result.usage.completion_tokens)
    if record.activations is not None:
        pipe.hincrby(counters, "captured_bytes", record.activations.bytes)
    if record.started_at is not None:
        stats.observe(pipe, record.model, "queue_wait", (record.started_at - record.created_at).total_seconds())
        if record.finished_at is not None:
            stats.observe(pipe, record.model, "duration", (record.finished_at - record.started_at).total_seconds())


class JobStore:
    """Reads and changes JobRecords. Every change is a WATCH/MULTI transaction on one key.

    `outage_seconds` > 0 (the worker's store): claim and finish wait out a Redis outage of up to
    that long, retrying with backoff, so a job's outcome is recorded once Redis is back instead of
    being lost. 0 (the API's store): errors surface at once and the API answers 503.
    """

    def __init__(self, client: redis.Redis, retention_seconds: int, outage_seconds: float = 0) -> None:
        self.redis = client
        self.retention = retention_seconds
        self.outage_seconds = outage_seconds

    def _through_outage(self, call: Callable[[], object]):
        if not self.outage_seconds:
            return call()
        retrying = stamina.retry_context(
            on=(redis.ConnectionError, redis.TimeoutError), attempts=None, timeout=self.outage_seconds, wait_initial=0.1, wait_max=2.0
        )
        for attempt in retrying:
            with attempt:
                return call()

    def create(self, record: JobRecord) -> None:
        if not self.redis.set(keys.job(record.id), record.model_dump_json(), nx=True, ex=self.retention):
            raise RuntimeError(f"job {record.id} already exists")

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.get(keys.job(job_id))
        return None if raw is None else JobRecord.model_validate_json(raw)

    def delete(self, job_id: str) -> None:
        self.redis.delete(keys.job(job_id))

    def update(self, job_id: str, change: Callable[[JobRecord], JobRecord | None]) -> JobRecord | None:
        """Apply `change` atomically. It returns the new record, or None to leave the job as it is.

        Returns what was written, or None when nothing was (unknown job, or `change` declined).
        """
        key = keys.job(job_id)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        pipe.unwatch()
                        return None
                    old = JobRecord.model_validate_json(raw)
                    new = change(old)
                    if new is None:
                        pipe.unwatch()
                        return None
                    pipe.multi()
                    pipe.set(key, new.model_dump_json(), keepttl=True)
                    pipe.publish(keys.job_events(job_id), new.status.value)
                    if new.status.terminal and not old.status.terminal:
                        _record_stats(pipe, new)
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue

    def claim(self, job_id: str, worker: str, max_attempts: int) -> tuple[JobRecord | None, str]:
        """Move a delivered job to running. Returns (record, why): record is None when it must not run.

        A terminal job is never re-run (a redelivered message does nothing). A job delivered
        `max_attempts` times already is failed as `worker_lost` instead of run again.
        """
        outcome = {"why": "unknown job"}

        def change(record: JobRecord) -> JobRecord | None:
            if record.status.terminal:
                outcome["why"] = f"already {record.status.value}"
                return None
            if record.attempts >= max_attempts:
                outcome["why"] = "too many attempts"
                return record.model_copy(
                    update={
                        "status": JobStatus.failed,
                        "finished_at": now(),
                        "error": JobError(
                            type="worker_lost",
                            message=f"the worker running this job was lost {record.attempts} times; giving up",
                        ),
                    }
                )
            outcome["why"] = "claimed"
            return record.model_copy(
                update={
                    "status": JobStatus.running,
                    "started_at": now(),
                    "attempts": record.attempts + 1,
                    "worker": worker,
                    "error": None,
                }
            )

        def apply() -> JobRecord | None:
            record = self.update(job_id, change)
            if record is not None:
                self.redis.zrem(keys.queued(record.model), job_id)
            return record

        record = self._through_outage(apply)
        if record is None or record.status is not JobStatus.running:
            return None, outcome["why"]
        return record, outcome["why"]

    def finish(self, job_id: str, **fields: object) -> JobRecord | None:
        """Move a running job to a terminal state (`status` in fields). A terminal job is left alone."""

        def change(record: JobRecord) -> JobRecord | None:
            if record.status.terminal:
                return None
            data = record.model_dump()
            data.update(fields, finished_at=now())
            return JobRecord.model_validate(data)

        return self._through_outage(lambda: self.update(job_id, change))

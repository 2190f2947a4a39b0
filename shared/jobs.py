"""The job store: every operation on a job's Redis keys, in one place.

Keys (see shared/keys.py): the JSON JobRecord, the model's queued set (queue positions), the
owner's index (GET /jobs), the cancel flag and the progress counter of a running job, and the
Celery message on the model's queue list. State changes are WATCH/MULTI transactions on the record,
so they cannot race: a terminal record is never changed again.

Who calls what: the API enqueues, reads, lists, cancels and deletes; the worker claims, reports
progress (reading the cancel flag), and finishes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
import stamina
from celery import Celery

from shared import broker, keys, stats
from shared.errors import JobCancelled, JobFailure, WorkerLost
from shared.schemas import JobRecord, JobStatus

T = TypeVar("T")


def now() -> datetime:
    return datetime.now(UTC)


def _record_stats(pipe: Any, record: JobRecord) -> None:
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


def _live_fields(record: JobRecord, rank: int | None, tokens: bytes | str | None) -> dict[str, int | None]:
    if record.status is JobStatus.queued:
        return {"queue_position": None if rank is None else rank + 1}
    if record.status is JobStatus.running:
        return {"generated_tokens": int(tokens) if tokens is not None else 0}
    return {}


class JobStore:
    """Reads and changes jobs in Redis.

    `outage_seconds` > 0 (the worker's store): claim and finish wait out a Redis outage of up to
    that long, retrying with backoff, so a job's outcome is recorded once Redis is back instead of
    being lost. 0 (the API's store): errors surface at once and the API answers 503.
    `aclient` (the API's): a redis.asyncio client for the reads on the event loop.
    """

    def __init__(
        self,
        client: redis.Redis,
        retention_seconds: int,
        outage_seconds: float = 0,
        aclient: aioredis.Redis | None = None,
    ) -> None:
        self.redis = client
        self.aredis = aclient
        self.retention = retention_seconds
        self.outage_seconds = outage_seconds

    def _through_outage(self, call: Callable[[], T]) -> T:
        if not self.outage_seconds:
            return call()
        retrying = stamina.retry_context(
            on=(redis.ConnectionError, redis.TimeoutError),
            attempts=None,
            timeout=self.outage_seconds,
            wait_initial=0.1,
            wait_max=2.0,
        )
        for attempt in retrying:
            with attempt:
                return call()
        raise AssertionError("unreachable: stamina retries until it returns or raises")

    # -- creating ---------------------------------------------------------------------------

    def _queue_writes(self, pipe: Any, record: JobRecord, celery: Celery) -> int:
        """A new job's writes: its record (SET NX), its place in the model's queue and in its
        owner's indexes, the submitted counter, and its broker message (job id only). Returns the
        position of the SET's reply among the pipeline's replies."""
        created = record.created_at.timestamp()
        position = len(pipe.command_stack)
        pipe.set(keys.job(record.id), record.model_dump_json(), nx=True, ex=self.retention)
        pipe.zadd(keys.queued(record.model), {record.id: created})
        pipe.zadd(keys.jobs_index(record.owner), {record.id: created})
        pipe.zadd(keys.jobs_status_index(record.owner, record.status.value), {record.id: created})
        stats.count_submitted(pipe, record.model)
        queue = keys.queue(record.model)
        pipe.lpush(queue, broker.task_message(celery, record.id, queue))
        return position

    def enqueue(self, records: Sequence[JobRecord], celery: Celery) -> None:
        """Record and queue new jobs in one transaction: all of them or none."""
        if not records:
            return
        with self.redis.pipeline(transaction=True) as pipe:
            positions = [self._queue_writes(pipe, record, celery) for record in records]
            self._check_created(records, positions, pipe.execute())

    async def enqueue_async(self, record: JobRecord, celery: Celery) -> None:
        """`enqueue` of one job on the event loop (the API's hot path)."""
        assert self.aredis is not None, "JobStore was built without an async client"
        async with self.aredis.pipeline(transaction=True) as pipe:
            position = self._queue_writes(pipe, record, celery)
            self._check_created([record], [position], await pipe.execute())

    def _check_created(self, records: Sequence[JobRecord], positions: list[int], replies: list[Any]) -> None:
        for record, position in zip(records, positions, strict=True):
            if not replies[position]:
                raise RuntimeError(f"job {record.id} already exists")

    # -- reading ----------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.get(keys.job(job_id))
        return None if raw is None else JobRecord.model_validate_json(raw)

    async def get_async(self, job_id: str) -> JobRecord | None:
        assert self.aredis is not None, "JobStore was built without an async client"
        raw = await self.aredis.get(keys.job(job_id))
        return None if raw is None else JobRecord.model_validate_json(raw)

    def live_fields(self, record: JobRecord) -> dict[str, int | None]:
        """Where a queued job stands in its model's queue (1 = next); how far a running job has got."""
        rank = self.redis.zrank(keys.queued(record.model), record.id) if record.status is JobStatus.queued else None
        tokens = self.redis.get(keys.progress(record.id)) if record.status is JobStatus.running else None
        return _live_fields(record, cast("int | None", rank), tokens)  # zrank without withscore: an int

    async def live_fields_async(self, record: JobRecord) -> dict[str, int | None]:
        assert self.aredis is not None, "JobStore was built without an async client"
        rank = tokens = None
        if record.status is JobStatus.queued:
            rank = await self.aredis.zrank(keys.queued(record.model), record.id)
        elif record.status is JobStatus.running:
            tokens = await self.aredis.get(keys.progress(record.id))
        return _live_fields(record, cast("int | None", rank), tokens)  # zrank without withscore: an int

    def queue_depth(self, model: str) -> int:
        """How many jobs of `model` wait in its queue."""
        return int(self.redis.zcard(keys.queued(model)))

    async def queue_depths_async(self, models: list[str]) -> dict[str, int]:
        """`queue_depth` of many models in one round trip on the event loop."""
        assert self.aredis is not None, "JobStore was built without an async client"
        async with self.aredis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.zcard(keys.queued(model))
            return {model: int(n) for model, n in zip(models, await pipe.execute(), strict=True)}

    def list(self, owner: str | None, status: JobStatus | None, limit: int) -> list[JobRecord]:
        """An owner's jobs (all jobs when keys are off), newest first, all or in one state (read
        from that state's index, not filtered from all); records past their retention leave the
        index on the way."""
        index = keys.jobs_index(owner) if status is None else keys.jobs_status_index(owner, status.value)
        found: list[JobRecord] = []
        start = 0
        while len(found) < limit:
            ids = [i.decode() for i in cast("list[bytes]", self.redis.zrevrange(index, start, start + 4 * limit - 1))]
            if not ids:
                break
            start += len(ids)
            raws = self.redis.mget([keys.job(i) for i in ids])
            expired = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            if expired:
                self.redis.zrem(index, *expired)
                start -= len(expired)
            for raw in raws:
                if raw is not None:
                    record = JobRecord.model_validate_json(raw)
                    if status is None or record.status is status:
                        found.append(record)
        return found[:limit]

    # -- changing ---------------------------------------------------------------------------

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
                    if new.status is not old.status:
                        created = new.created_at.timestamp()
                        pipe.zrem(keys.jobs_status_index(new.owner, old.status.value), job_id)
                        pipe.zadd(keys.jobs_status_index(new.owner, new.status.value), {job_id: created})
                    if new.status is not JobStatus.queued:
                        pipe.zrem(keys.queued(new.model), job_id)
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
                lost = WorkerLost(f"the worker running this job was lost {record.attempts} times; giving up")
                return _ended(record, lost, None)
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

        record = self._through_outage(lambda: self.update(job_id, change))
        if record is None or record.status is not JobStatus.running:
            return None, outcome["why"]
        return record, outcome["why"]

    def succeed(self, job_id: str, result: dict[str, Any], activations: dict[str, Any] | None) -> JobRecord | None:
        """A running job's result (and manifest). A terminal job is left alone."""

        def change(record: JobRecord) -> JobRecord | None:
            if record.status.terminal:
                return None
            data = record.model_dump()
            data.update(status=JobStatus.succeeded, result=result, activations=activations, finished_at=now())
            return JobRecord.model_validate(data)

        return self._through_outage(lambda: self.update(job_id, change))

    def fail(self, job_id: str, failure: JobFailure, result: dict[str, Any] | None = None) -> JobRecord | None:
        """End a job with `failure` (a JobCancelled ends it `cancelled`, anything else `failed`),
        keeping a partial `result` when given. A terminal job is left alone."""
        return self._through_outage(
            lambda: self.update(job_id, lambda r: None if r.status.terminal else _ended(r, failure, result))
        )

    def cancel_queued(self, job_id: str, failure: JobCancelled) -> JobRecord | None:
        """A queued job becomes `cancelled` (the worker skips it); None when it is no longer queued."""
        return self.update(job_id, lambda r: _ended(r, failure, None) if r.status is JobStatus.queued else None)

    def request_cancel(self, job_id: str) -> None:
        """Ask the worker running this job to stop it (it reads the flag while generating)."""
        self.redis.set(keys.cancel(job_id), 1, ex=self.retention)

    def report_progress(self, job_id: str, generated_tokens: int) -> bool:
        """The worker's word while it generates: store the progress; True when a cancel was asked."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(keys.cancel(job_id))
            pipe.set(keys.progress(job_id), generated_tokens, ex=self.retention)
            cancelled, _ = pipe.execute()
        return bool(cancelled)

    def delete(self, record: JobRecord) -> None:
        """Remove a finished job's record, flags, index entry and Idempotency-Key (a retry with the
        key then makes a new job at once instead of waiting for a record that is gone); its files
        are the store's to remove."""
        job_id = record.id
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.job(job_id), keys.cancel(job_id), keys.progress(job_id))
            if record.idempotency is not None:
                pipe.delete(record.idempotency)
            pipe.zrem(keys.jobs_index(record.owner), job_id)
            pipe.zrem(keys.jobs_status_index(record.owner, record.status.value), job_id)
            pipe.execute()


def _ended(record: JobRecord, failure: JobFailure, result: dict[str, Any] | None) -> JobRecord:
    status = JobStatus.cancelled if isinstance(failure, JobCancelled) else JobStatus.failed
    data = record.model_dump()
    data.update(status=status, error=failure.as_error(), finished_at=now())
    if result is not None:
        data["result"] = result
    return JobRecord.model_validate(data)

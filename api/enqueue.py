"""Queueing a checked request (api/submit_checks.py `plan`): the record and its Celery message
(carrying only the job id) written in one atomic step by the job store, which also holds the
job's estimated capture bytes against its API key's limits (ACTQ_MAX_QUEUED_JOBS_PER_KEY,
ACTQ_MAX_QUEUED_BYTES_PER_KEY): 429 beyond them, nothing queued. An Idempotency-Key seen before
gives back the job it created."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

import redis
from fastapi.concurrency import run_in_threadpool

from api.deps import Services
from api.limits import QuotaExceeded
from api.submit_checks import Plan, plan
from shared import keys
from shared.errors import ActqError, BadRequest, Conflict
from shared.idempotency import scoped
from shared.jobs import OverQuota, now
from shared.schemas import BatchEntry, JobRecord, JobRequest, JobStatus

T = TypeVar("T")


async def off_loop(services: Services, caller: str | None, costly: bool, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` (a submission) on a thread: when `costly` (api/submit_checks.py `heavy`), one of
    the check pool's threads in `caller`'s turn (api/check_pool.py), else the default pool."""
    if costly:
        return await services.checks.run(caller, fn, *args)
    return await run_in_threadpool(fn, *args)


def _limits(services: Services) -> tuple[int, int]:
    return services.settings.max_queued_jobs_per_key, services.settings.max_queued_bytes_per_key


def queued_record(
    job_id: str,
    request: JobRequest,
    plan: Plan,
    owner: str | None,
    created_at: datetime | None = None,
    idempotency_key: str | None = None,
) -> JobRecord:
    """A new job's record, as every submission path creates it (`idempotency_key`: scoped)."""
    max_tokens, points, _, edits = plan
    return JobRecord(
        idempotency=None if idempotency_key is None else keys.idempotency(idempotency_key),
        id=job_id,
        status=JobStatus.queued,
        model=request.model,
        request=request,
        max_tokens=max_tokens,
        capture_points=points,
        edit_points=edits,
        created_at=created_at or now(),
        owner=owner,
    )


async def submit_now(services: Services, request: JobRequest, owner: str | None = None) -> JobRecord:
    """`submit` without an Idempotency-Key, on the event loop (redis.asyncio): the common case of
    POST /jobs, with no threadpool hop. Same checks, same single transaction."""
    cache: dict[tuple[str, ...], object] = {}
    info = await services.registry.get_async(request.model)
    if info is not None:
        cache[("model", request.model)] = info
    job_plan = plan(services, request, cache, owner)
    record = queued_record(str(uuid.uuid4()), request, job_plan, owner)
    try:
        await services.jobs.enqueue_async(record, services.celery, job_plan[2], _limits(services))
    except OverQuota as exc:
        raise QuotaExceeded(exc.message) from None
    return record


def submit(
    services: Services, request: JobRequest, idempotency_key: str | None, owner: str | None = None
) -> tuple[JobRecord, bool]:
    """Record and enqueue a job. Returns (record, created): an Idempotency-Key seen before gives
    back the job it created, and nothing new is enqueued."""
    job_plan = plan(services, request, owner=owner)
    job_id = str(uuid.uuid4())
    key = None if idempotency_key is None else scoped(idempotency_key, owner)
    if key is not None:
        existing = services.idempotency.claim(key, job_id)
        if existing is not None:
            if existing.request != request:
                raise Conflict("this Idempotency-Key was used for a different request; use a new key")
            return existing, False
    record = queued_record(job_id, request, job_plan, owner, idempotency_key=key)
    try:
        services.jobs.enqueue([record], services.celery, [job_plan[2]], _limits(services))
    except OverQuota as exc:
        services.idempotency.release([key])
        raise QuotaExceeded(exc.message) from None
    except redis.RedisError:
        services.idempotency.release([key])
        raise
    return record, True


def submit_batch(
    services: Services, entries: list[BatchEntry], owner: str | None = None, label: str = "jobs"
) -> list[tuple[JobRecord, bool]]:
    """Validate every entry first (the first bad one rejects the batch, naming its index as
    `label[i]`), then record all new jobs and their messages in one Redis transaction."""
    cache: dict[tuple[str, ...], object] = {}
    plans = []
    for index, entry in enumerate(entries):
        try:
            plans.append(plan(services, entry.request, cache, owner))
        except ActqError as exc:
            raise type(exc)(f"{label}[{index}]: {exc.message}") from exc
    given = [e.idempotency_key for e in entries]  # as the caller wrote them, for messages
    if len({k for k in given if k}) != len([k for k in given if k]):
        raise BadRequest("two entries of the batch share an idempotency_key")
    ids = [str(uuid.uuid4()) for _ in entries]
    scoped_keys = [None if k is None else scoped(k, owner) for k in given]
    wanted = [(i, key) for i, key in enumerate(scoped_keys) if key]
    found = services.idempotency.claim_many([(key, ids[i]) for i, key in wanted])
    existing: list[JobRecord | None] = [None] * len(entries)
    for (i, _), record in zip(wanted, found, strict=True):
        existing[i] = record
    claimed = [key for (i, key) in wanted if existing[i] is None]
    for i, old in enumerate(existing):
        if old is not None and old.request != entries[i].request:
            services.idempotency.release(claimed)
            raise Conflict(f"{label}[{i}]: idempotency_key {given[i]!r} was used for a different request")
    created_at = now()
    out = [
        (old, False)
        if old is not None
        else (queued_record(job_id, entry.request, job_plan, owner, created_at, key), True)
        for entry, job_id, job_plan, old, key in zip(entries, ids, plans, existing, scoped_keys, strict=True)
    ]
    new = [(record, job_plan[2]) for (record, created), job_plan in zip(out, plans, strict=True) if created]
    try:
        services.jobs.enqueue([r for r, _ in new], services.celery, [size for _, size in new], _limits(services))
    except OverQuota as exc:
        services.idempotency.release(claimed)
        raise QuotaExceeded(exc.message) from None
    except redis.RedisError:
        services.idempotency.release(claimed)
        raise
    return out

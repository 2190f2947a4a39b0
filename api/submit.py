"""Turning a valid-looking request into a queued job: checks against the served model and the
capture budget, then the record and its Celery message (carrying only the job id) written in one
Redis transaction (see shared/enqueue.py)."""

from __future__ import annotations

import contextlib
import time
import uuid

import redis

from api.deps import Services
from shared import capture_spec, keys, stats
from shared.errors import ActqError, BadRequest, Conflict, NotReady, UnknownModel
from shared.enqueue import enqueue
from shared.jobs import now
from shared.schemas import BatchEntry, CapturePoint, JobRecord, JobRequest, JobStatus


def plan(services: Services, request: JobRequest, cache: dict | None = None) -> tuple[int, list[CapturePoint]]:
    """Everything that can be refused before a job exists. Returns max_tokens and the capture points.
    `cache` (one per batch) keeps model descriptions and resolved specs across entries."""
    settings = services.settings
    cache = {} if cache is None else cache
    if ("model", request.model) not in cache:
        cache[("model", request.model)] = services.registry.get(request.model)
    info = cache[("model", request.model)]
    if info is None:
        served = ", ".join(services.registry.names()) or "none yet (is a worker running?)"
        raise UnknownModel(f"model {request.model!r} is not served here; served models: {served}")
    max_tokens = request.max_tokens or settings.max_tokens_default
    if max_tokens > settings.max_tokens_limit:
        raise BadRequest(f"max_tokens {max_tokens} exceeds the limit of {settings.max_tokens_limit} (ACTQ_MAX_TOKENS_LIMIT)")
    if request.time_limit is not None and request.time_limit > settings.job_soft_time_limit:
        raise BadRequest(
            f"time_limit {request.time_limit:g}s exceeds this deployment's limit of {settings.job_soft_time_limit:g}s "
            "(ACTQ_JOB_SOFT_TIME_LIMIT); ask for less or leave it out"
        )
    if info.max_context and max_tokens >= info.max_context:
        raise BadRequest(f"max_tokens {max_tokens} leaves no room for a prompt in {info.name}'s context of {info.max_context}")
    if request.capture is None:
        return max_tokens, []
    spec_key = ("spec", request.model, request.capture.model_dump_json())
    if spec_key not in cache:
        cache[spec_key] = capture_spec.resolve(request.capture, info)
    points = cache[spec_key]
    estimate = capture_spec.estimate_bytes(request, points, info, max_tokens)
    capture_spec.check_budget(estimate, settings.capture_budget_bytes)
    return max_tokens, points


def _claim_idempotency_key(services: Services, key: str, job_id: str) -> JobRecord | None:
    """None when `job_id` now owns the key; else the job an earlier request with the key created."""
    idem = keys.idempotency(key)
    if services.redis.set(idem, job_id, nx=True, ex=services.settings.job_retention_seconds):
        return None
    owner = services.redis.get(idem)
    deadline = time.monotonic() + 2.0
    while owner is not None and time.monotonic() < deadline:  # the first request may still be recording it
        record = services.jobs.get(owner.decode())
        if record is not None:
            return record
        time.sleep(0.02)
        owner = services.redis.get(idem)
    if owner is None:  # the first request failed and released the key
        return _claim_idempotency_key(services, key, job_id)
    if _take_over(services, idem, owner, job_id):  # the first request died before recording its job
        return None
    raise NotReady("a request with this Idempotency-Key is still being recorded; retry shortly")


def _take_over(services: Services, idem: str, stale: bytes, job_id: str) -> bool:
    """Move a key to `job_id` if it still names `stale`, a job that was never recorded (its job
    and message are written in the transaction right after the key is claimed, so a key whose job
    has not appeared within the wait belongs to a request that did not get that far)."""
    with services.redis.pipeline() as pipe:
        try:
            pipe.watch(idem, keys.job(stale.decode()))
            if pipe.get(idem) != stale or pipe.exists(keys.job(stale.decode())):
                return False
            pipe.multi()
            pipe.set(idem, job_id, ex=services.settings.job_retention_seconds)
            pipe.execute()
            return True
        except redis.WatchError:
            return False


async def submit_now(services: Services, request: JobRequest, owner: str | None = None) -> JobRecord:
    """`submit` without an Idempotency-Key, on the event loop (redis.asyncio): the common case of
    POST /jobs, with no threadpool hop. Same checks, same single transaction."""
    cache: dict = {}
    info = services.registry.cached(request.model)
    if info is None:
        info = services.registry.remember(await services.aredis.get(keys.model(request.model)))
    if info is not None:
        cache[("model", request.model)] = info
    max_tokens, points = plan(services, request, cache)  # unknown model: the registry names the served ones
    record = _queued(str(uuid.uuid4()), request, max_tokens, points, owner)
    async with services.aredis.pipeline(transaction=True) as pipe:
        _record_queued(pipe, record, services.settings.job_retention_seconds, services.celery)
        if not (await pipe.execute())[0]:
            raise RuntimeError(f"job {record.id} already exists")
    return record


def submit(services: Services, request: JobRequest, idempotency_key: str | None, owner: str | None = None) -> tuple[JobRecord, bool]:
    """Record and enqueue a job. Returns (record, created): an Idempotency-Key seen before gives
    back the job it created, and nothing new is enqueued."""
    max_tokens, points = plan(services, request)
    job_id = str(uuid.uuid4())
    if idempotency_key is not None:
        idempotency_key = _scoped(idempotency_key, owner)
        existing = _claim_idempotency_key(services, idempotency_key, job_id)
        if existing is not None:
            if existing.request != request:
                raise Conflict("this Idempotency-Key was used for a different request; use a new key")
            return existing, False
    record = _queued(job_id, request, max_tokens, points, owner)
    try:
        with services.redis.pipeline(transaction=True) as pipe:  # record and message: one round trip, all or nothing
            _record_queued(pipe, record, services.settings.job_retention_seconds, services.celery)
            created = pipe.execute()[0]
    except redis.RedisError:
        _release(services, [idempotency_key])
        raise
    if not created:
        raise RuntimeError(f"job {job_id} already exists")
    return record, True


def _release(services: Services, idempotency_keys: list[str | None]) -> None:
    """Nothing was queued: free the idempotency keys this request claimed (best effort; a key
    left behind is taken over by the next request after the wait in _claim_idempotency_key)."""
    claimed = [keys.idempotency(k) for k in idempotency_keys if k]
    if claimed:
        with contextlib.suppress(redis.RedisError):
            services.redis.delete(*claimed)


def _queued(job_id: str, request: JobRequest, max_tokens: int, points: list[CapturePoint], owner: str | None,
            created_at=None) -> JobRecord:  # fmt: skip
    return JobRecord(
        id=job_id, status=JobStatus.queued, model=request.model, request=request, max_tokens=max_tokens,
        capture_points=points, created_at=created_at or now(), owner=owner,
    )  # fmt: skip


def _record_queued(pipe, record: JobRecord, retention: int, celery) -> None:
    """A new job's writes: its record (SET NX, first in the pipeline), its broker message, its
    place in the model's queue and in its owner's list, and the submitted counter."""
    created = record.created_at.timestamp()
    pipe.set(keys.job(record.id), record.model_dump_json(), nx=True, ex=retention)
    pipe.zadd(keys.queued(record.model), {record.id: created})
    pipe.zadd(keys.jobs_index(record.owner), {record.id: created})
    stats.count_submitted(pipe, record.model)
    enqueue(pipe, celery, record.id, record.model)


def _scoped(key: str, owner: str | None) -> str:
    """Idempotency keys are per API key: two callers never share a job through a key."""
    return key if owner is None else f"{owner}:{key}"


def submit_batch(services: Services, entries: list[BatchEntry], owner: str | None = None) -> list[tuple[JobRecord, bool]]:
    """Validate every entry first (the first bad one rejects the batch, naming its index), then
    record all new jobs in one Redis pipeline and publish them over one broker connection."""
    cache: dict = {}
    plans = []
    for index, entry in enumerate(entries):
        try:
            plans.append(plan(services, entry.request, cache))
        except ActqError as exc:
            raise type(exc)(f"jobs[{index}]: {exc.message}") from exc
    keys_wanted = [e.idempotency_key for e in entries]
    if len(set(k for k in keys_wanted if k)) != len([k for k in keys_wanted if k]):
        raise BadRequest("two entries of the batch share an idempotency_key")
    ids = [str(uuid.uuid4()) for _ in entries]
    given = [e.idempotency_key for e in entries]  # as the caller wrote them, for messages
    if owner is not None:
        entries = [e.model_copy(update={"idempotency_key": e.idempotency_key and _scoped(e.idempotency_key, owner)}) for e in entries]
    existing = _claim_batch_keys(services, entries, ids, given)
    retention = services.settings.job_retention_seconds
    out: list[tuple[JobRecord, bool]] = []
    fresh: list[JobRecord] = []
    created_at = now()
    for entry, job_id, (max_tokens, points), old in zip(entries, ids, plans, existing):
        if old is not None:
            out.append((old, False))
            continue
        record = _queued(job_id, entry.request, max_tokens, points, owner, created_at)
        fresh.append(record)
        out.append((record, True))
    claimed = [e.idempotency_key for e, old in zip(entries, existing) if e.idempotency_key and old is None]
    try:
        with services.redis.pipeline(transaction=True) as pipe:  # every record and message, or none
            for record in fresh:
                _record_queued(pipe, record, retention, services.celery)
            pipe.execute()
    except redis.RedisError:
        _release(services, claimed)
        raise
    return out


def _claim_batch_keys(
    services: Services, entries: list[BatchEntry], ids: list[str], given: list[str | None]
) -> list[JobRecord | None]:
    """Claim every entry's idempotency key at once; the records of keys used before (None for new)."""
    keyed = [(i, e) for i, e in enumerate(entries) if e.idempotency_key]
    found: list[JobRecord | None] = [None] * len(entries)
    if not keyed:
        return found
    retention = services.settings.job_retention_seconds
    with services.redis.pipeline(transaction=False) as pipe:
        for i, entry in keyed:
            pipe.set(keys.idempotency(entry.idempotency_key), ids[i], nx=True, ex=retention)
        claimed = pipe.execute()
    mine = [keys.idempotency(e.idempotency_key) for (i, e), ok in zip(keyed, claimed) if ok]
    try:
        for (i, entry), ok in zip(keyed, claimed):
            if not ok:
                found[i] = _claim_idempotency_key(services, entry.idempotency_key, ids[i])
                if found[i] is not None and found[i].request != entry.request:
                    raise Conflict(f"jobs[{i}]: idempotency_key {given[i]!r} was used for a different request")
    except ActqError:
        if mine:
            services.redis.delete(*mine)
        raise
    return found

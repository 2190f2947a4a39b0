"""Turning a valid-looking request into a queued job: checks against the served model, the capture
budget, the record in Redis, then the Celery message (carrying only the job id)."""

from __future__ import annotations

import time
import uuid

from kombu.exceptions import OperationalError

from api.deps import Services
from shared import capture_spec, keys
from shared.errors import BadRequest, Conflict, NotReady, ServiceUnavailable, UnknownModel
from shared.jobs import now
from shared.schemas import CapturePoint, JobRecord, JobRequest, JobStatus


def plan(services: Services, request: JobRequest) -> tuple[int, list[CapturePoint]]:
    """Everything that can be refused before a job exists. Returns max_tokens and the capture points."""
    settings = services.settings
    info = services.registry.get(request.model)
    if info is None:
        served = ", ".join(services.registry.names()) or "none yet (is a worker running?)"
        raise UnknownModel(f"model {request.model!r} is not served here; served models: {served}")
    max_tokens = request.max_tokens or settings.max_tokens_default
    if max_tokens > settings.max_tokens_limit:
        raise BadRequest(f"max_tokens {max_tokens} exceeds the limit of {settings.max_tokens_limit} (ACTQ_MAX_TOKENS_LIMIT)")
    if info.max_context and max_tokens >= info.max_context:
        raise BadRequest(f"max_tokens {max_tokens} leaves no room for a prompt in {info.name}'s context of {info.max_context}")
    if request.capture is None:
        return max_tokens, []
    points = capture_spec.resolve(request.capture, info)
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
    raise NotReady("a request with this Idempotency-Key is still being recorded; retry shortly")


def submit(services: Services, request: JobRequest, idempotency_key: str | None) -> tuple[JobRecord, bool]:
    """Record and enqueue a job. Returns (record, created): an Idempotency-Key seen before gives
    back the job it created, and nothing new is enqueued."""
    max_tokens, points = plan(services, request)
    job_id = str(uuid.uuid4())
    if idempotency_key is not None:
        existing = _claim_idempotency_key(services, idempotency_key, job_id)
        if existing is not None:
            if existing.request != request:
                raise Conflict("this Idempotency-Key was used for a different request; use a new key")
            return existing, False
    record = JobRecord(
        id=job_id, status=JobStatus.queued, model=request.model, request=request, max_tokens=max_tokens,
        capture_points=points, created_at=now(),
    )
    services.jobs.create(record)
    try:
        services.celery.send_task(keys.TASK_NAME, args=[job_id], task_id=job_id, queue=keys.queue(request.model))
    except OperationalError as exc:
        services.jobs.delete(job_id)
        if idempotency_key is not None:
            services.redis.delete(keys.idempotency(idempotency_key))
        raise ServiceUnavailable("the broker cannot be reached; nothing was enqueued, try again shortly") from exc
    return record, True

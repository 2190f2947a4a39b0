"""Turning a valid-looking request into a queued job: checks against the served model, the capture
budget, the record in Redis, then the Celery message (carrying only the job id)."""

from __future__ import annotations

import uuid

from kombu.exceptions import OperationalError

from api.deps import Services
from shared import capture_spec, keys
from shared.errors import BadRequest, ServiceUnavailable, UnknownModel
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


def submit(services: Services, request: JobRequest, idempotency_key: str | None) -> tuple[JobRecord, bool]:
    """Record and enqueue a job. Returns (record, created): an Idempotency-Key seen before gives
    back the job it created, and nothing new is enqueued."""
    max_tokens, points = plan(services, request)
    job_id = str(uuid.uuid4())
    if idempotency_key is not None:
        idem = keys.idempotency(idempotency_key)
        if not services.redis.set(idem, job_id, nx=True, ex=services.settings.job_retention_seconds):
            existing = services.redis.get(idem)
            record = services.jobs.get(existing.decode()) if existing else None
            if record is not None:
                return record, False
            services.redis.set(idem, job_id, ex=services.settings.job_retention_seconds)
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

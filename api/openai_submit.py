"""Submitting the jobs of one OpenAI request: one job per choice (prompts x `n`), queued together
or not at all, each with its share of the request's Idempotency-Key. Used by the answered routes
(api/routes/openai.py) and the streamed ones (api/openai_stream.py)."""

from __future__ import annotations

import hashlib

from api.default_capture import with_default_capture
from api.deps import Services
from api.submit import submit, submit_batch
from shared.schemas import BatchEntry, JobRecord, JobRequest


def fanout_keys(idempotency_key: str | None, count: int) -> list[str | None]:
    """Each fanned-out job's Idempotency-Key: the header's with `#i` (hashed when that is too long)."""
    if idempotency_key is None:
        return [None] * count
    if count == 1:
        return [idempotency_key]
    base = idempotency_key if len(idempotency_key) <= 240 else hashlib.sha256(idempotency_key.encode()).hexdigest()
    return [f"{base}#{i}" for i in range(count)]


def submit_choices(
    services: Services, job_requests: list[JobRequest], idempotency_key: str | None, caller: str | None
) -> list[tuple[JobRecord, bool]]:
    """Each job's record and whether it was created now (False: an Idempotency-Key replay). One
    job: as POST /jobs. Several: validated together and queued in one transaction (nothing is
    queued when one is bad), as POST /jobs/batch. A request without a capture gets the
    deployment's default one."""
    job_requests = [with_default_capture(services.settings, r, caller) for r in job_requests]
    if len(job_requests) == 1:
        return [submit(services, job_requests[0], idempotency_key, caller)]
    entries = [
        BatchEntry.model_construct(request=r, idempotency_key=k)
        for r, k in zip(job_requests, fanout_keys(idempotency_key, len(job_requests)), strict=True)
    ]
    return submit_batch(services, entries, owner=caller, label="choice")

"""The one submit-and-wait flow of the OpenAI routes, answered (api/routes/openai.py) and streamed
(api/openai/stream.py) alike.

One job per choice (prompts x `n`), queued together or not at all, each with its share of the
request's Idempotency-Key. In order: a long-poll place is taken (at capacity the 429 comes before
anything is queued, so a client's own retry cannot make a second job), a text over the context is
refused (api/context_check.py), then the jobs are submitted on a thread (the check pool's when the
request is heavy: api/check_pool.py), where a request without a capture gets the deployment's
default one (api/default_capture.py), once; then each job's wait starts. A finished job's record
(`result`) is its whole result, or the error that answers for it, by the same rule for both routes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass

from api.context_check import refuse_overflow
from api.default_capture import with_default_capture
from api.deps import Services
from api.enqueue import off_loop, submit, submit_batch
from api.openai.errors import OpenAIError, after_queued, unfinished
from api.openai.responses import whole_result
from api.submit_checks import heavy
from shared.schemas import BatchEntry, JobRecord, JobRequest, JobStatus

log = logging.getLogger("actq.api")


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
    deployment's default one (here, and only here)."""
    job_requests = [with_default_capture(services.settings, r, caller) for r in job_requests]
    if len(job_requests) == 1:
        return [submit(services, job_requests[0], idempotency_key, caller)]
    entries = [
        BatchEntry.model_construct(request=r, idempotency_key=k)
        for r, k in zip(job_requests, fanout_keys(idempotency_key, len(job_requests)), strict=True)
    ]
    return submit_batch(services, entries, owner=caller, label="choice")


@dataclass(eq=False)
class Queued:
    """One choice's job as submitted: its record then, whether it was created now (False: an
    Idempotency-Key replay), and the wait for its end (its record then; None: no longer stored)."""

    record: JobRecord
    created: bool
    done: asyncio.Future[JobRecord | None]

    @property
    def job_id(self) -> str:
        return self.record.id


async def submit_and_wait(
    services: Services,
    held: AsyncExitStack,
    job_requests: list[JobRequest],
    *,
    large: bool,
    wait_seconds: float,
    idempotency_key: str | None,
    caller: str | None,
) -> list[Queued]:
    """Take a long-poll place, check, submit the jobs and start each one's wait (module
    docstring). The place and the waits are `held`'s: they end when it closes. `large`: the body
    was (api/bodies.py)."""
    await held.enter_async_context(services.waiters.slot(caller))
    await refuse_overflow(services, caller, job_requests)
    checks = heavy(job_requests, large)
    submitted = await off_loop(
        services, caller, checks, submit_choices, services, job_requests, idempotency_key, caller
    )
    queued = []
    for record, created in submitted:
        done = asyncio.ensure_future(services.waiters.wait(record.id, wait_seconds))
        held.callback(done.cancel)
        queued.append(Queued(record, created, done))
    return queued


async def result(services: Services, job: Queued, wait_seconds: float, idempotency_key: str | None) -> JobRecord:
    """A job's record with its whole result once it has succeeded (its logprobs and text stored
    apart included), else the error that answers for it: a wait that failed (the job is queued:
    no retry), a job no longer stored, one that failed, was cancelled or is still running."""
    try:
        record = await job.done
    except Exception as exc:  # whatever it is, the job is queued: say so, and no retry
        log.warning("waiting for job %s failed: %r", job.job_id, exc)
        raise after_queued(job.job_id, exc) from exc
    if record is None:
        # Deleted, expired or flushed while this request waited: not the server's fault, and not
        # worth a retry (the job is gone); GET /jobs/{id} answers the same 404.
        raise OpenAIError(
            404,
            f"job {job.job_id} was deleted or expired while this request waited for it",
            "job_not_found",
            job_id=job.job_id,
            retry=False,
        )
    if record.status is not JobStatus.succeeded:
        raise unfinished(record, wait_seconds, idempotency_key)
    return await whole_result(services.jobs, record)


async def finished(
    services: Services,
    job_requests: list[JobRequest],
    *,
    large: bool,
    wait_seconds: float,
    idempotency_key: str | None,
    caller: str | None,
) -> list[JobRecord]:
    """The answered routes: submit the jobs and wait for them; their records once all have
    succeeded, else the error of the first job in choice order that did not."""
    async with AsyncExitStack() as held:
        queued = await submit_and_wait(
            services,
            held,
            job_requests,
            large=large,
            wait_seconds=wait_seconds,
            idempotency_key=idempotency_key,
            caller=caller,
        )
        await asyncio.wait([job.done for job in queued])  # every job's end (or the wait's), then the first error
        return [await result(services, job, wait_seconds, idempotency_key) for job in queued]

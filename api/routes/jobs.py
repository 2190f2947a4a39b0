"""Jobs: submit, read, list, cancel and delete."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from api.bodies import body_schema, is_large, parsed
from api.deps import CallerDep, SeesAllDep, Services, ServicesDep, get_caller
from api.enqueue import off_loop, submit, submit_batch, submit_now
from api.presenters import view
from api.submit_checks import has_references, heavy
from api.visibility import load, load_async
from shared.errors import BadRequest, Conflict, JobCancelled, JobNotFound, NotReady
from shared.listing import CURSOR_HEADER, METADATA, UNREADABLE_HEADER, JobFilters, as_utc, decode_cursor, parse_tags
from shared.schemas import (
    MAX_USER_CHARS,
    BatchItem,
    BatchRequest,
    BatchResponse,
    JobRecord,
    JobRequest,
    JobStatus,
    JobSummary,
    JobView,
)
from shared.storage import job_prefix

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(get_caller)])
ERRORS: dict[int | str, dict[str, object]] = {404: {"description": "No such job"}}


@router.post(
    "",
    status_code=202,
    response_model=JobView,
    responses={404: {"description": "Unknown model"}, 413: {}, 422: {}, 503: {}},
    openapi_extra=body_schema(JobRequest),
)
async def create_job(
    body: Annotated[JobRequest, parsed(JobRequest)],
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=256)] = None,
) -> JobView:
    """Queue a chat completion with activation capture."""
    checks = heavy([body], await is_large(request))
    if idempotency_key is None and not has_references(body) and not checks:
        record, created = await submit_now(services, body, owner=caller), True
    else:  # may wait for a concurrent request with the same key, read stored vectors or check schemas: off the loop
        record, created = await off_loop(services, caller, checks, submit, services, body, idempotency_key, caller)
    response.headers["Location"] = str(request.url_for("get_job", job_id=record.id))
    if not created:
        response.status_code = 200
    return view(record, request)


@router.post(
    "/batch",
    status_code=202,
    response_model=BatchResponse,
    responses={404: {"description": "Unknown model"}, 409: {}, 413: {}, 422: {}, 503: {}},
    openapi_extra=body_schema(BatchRequest),
)
async def create_jobs(
    body: Annotated[BatchRequest, parsed(BatchRequest)], services: ServicesDep, caller: CallerDep, request: Request
) -> BatchResponse:
    """Queue many jobs at once: all are validated first; one bad entry rejects the batch (its index
    is in the message) and nothing is queued. Entries may carry an idempotency_key."""
    checks = heavy([entry.request for entry in body.jobs], await is_large(request))
    results = await off_loop(services, caller, checks, submit_batch, services, body.jobs, caller)
    return BatchResponse(jobs=[BatchItem(id=r.id, status=r.status.value, created=created) for r, created in results])


LIST_PARAMS = {"status", "limit", "user", "created_after", "cursor"}


@router.get("", response_model=list[JobSummary], responses={422: {"description": "A bad filter or cursor"}})
def list_jobs(
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    response: Response,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    user: Annotated[str | None, Query(max_length=MAX_USER_CHARS, description="Only jobs with this `user`.")] = None,
    created_after: Annotated[
        datetime | None, Query(description="Only jobs created after this time (ISO 8601; without a zone, UTC).")
    ] = None,
    cursor: Annotated[
        str | None, Query(max_length=200, description="Go on from a previous answer's x-actq-next-cursor header.")
    ] = None,
) -> list[JobSummary]:
    """The caller's jobs as summaries, newest first (with API keys, only the jobs made with the
    caller's key): id, status, model, times, a prompt preview, the error type, metadata and user.
    Filters, all of which must hold: `status`, `user`, `created_after` and `metadata.<key>=<value>`
    (one per key). When more may follow, the answer's `x-actq-next-cursor` header is the `cursor`
    to go on from. Results and manifests are read with GET /jobs/{id}. Jobs whose records a newer
    version of actq wrote, which this one cannot read, are not listed: the `x-actq-unreadable-jobs`
    header names them (GET /jobs/{id} of each says what it cannot read)."""
    params = request.query_params.multi_items()
    unknown = sorted({name for name, _ in params if name not in LIST_PARAMS and not name.startswith(METADATA)})
    if unknown:
        raise BadRequest(
            f"unknown query parameter {', '.join(map(repr, unknown))}: GET /jobs takes status, limit, user, "
            "created_after, cursor and metadata.<key>=<value>"
        )
    try:
        filters = JobFilters(
            status=status,
            tags=parse_tags(params),
            created_after=None if created_after is None else as_utc(created_after),
        )
        position = None if cursor is None else decode_cursor(cursor)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    page = services.jobs.page(caller, limit, filters, position)
    if page.cursor is not None:
        response.headers[CURSOR_HEADER] = page.cursor
    if page.unreadable:
        response.headers[UNREADABLE_HEADER] = ",".join(page.unreadable)
    return page.jobs


@router.get("/{job_id}", response_model=JobView, responses=ERRORS)
async def get_job(
    job_id: str,
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    operator: SeesAllDep,
    wait: Annotated[float, Query(ge=0, le=60, description="Seconds to wait for the job to finish (long poll).")] = 0,
) -> JobView:
    """A job's status, and its result and activations manifest once it has succeeded. With `wait`,
    the answer comes as soon as the job finishes (or after `wait` seconds), instead of polling."""
    record = await load_async(services, job_id, caller)
    if wait > 0 and not record.status.terminal:
        async with services.waiters.slot(caller):
            record = await services.waiters.wait(job_id, wait) or record
    return view(record, request, _shown(await services.jobs.live_fields_async(record), operator))


@router.get("/{job_id}/request", response_model=JobRequest, responses=ERRORS)
async def get_job_request(job_id: str, services: ServicesDep, caller: CallerDep) -> JobRequest:
    """The request a job was made from, as stored (the OpenAI routes' translation included): its
    whole prompt or messages, capture, metadata and user."""
    return (await load_async(services, job_id, caller)).request


@router.get("/{job_id}/result", responses={**ERRORS, 409: {"description": "No result yet"}})
async def get_job_result(job_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """A job's whole result (the `result` of GET /jobs/{id} with all its text and every
    log-probability entry). A result stored apart from the job's record is answered as the bytes
    stored, never parsed by the API."""
    record = await load_async(services, job_id, caller)
    if record.result is None:
        if not record.status.terminal:
            raise NotReady(f"job {job_id} is {record.status.value}; its result exists once it has finished")
        raise JobNotFound(f"job {job_id} ended {record.status.value} without a result")
    stored = record.result.stored
    if stored is None:
        return Response(record.result.model_dump_json(), media_type="application/json")
    if not await services.jobs.stored_result_exists_async(job_id):  # expired a moment before its record
        raise JobNotFound(f"the result of job {job_id} is no longer stored")
    return StreamingResponse(
        services.jobs.stream_stored_result(job_id, stored.bytes),
        media_type="application/json",
        headers={"content-length": str(stored.bytes)},
    )


@router.delete(
    "/{job_id}",
    status_code=200,
    response_model=JobView,
    responses={**ERRORS, 202: {"description": "Cancelling"}, 204: {"description": "Deleted"}},
)
def delete_job(
    job_id: str, services: ServicesDep, caller: CallerDep, operator: SeesAllDep, request: Request, response: Response
) -> Response | JobView:
    """A queued job is cancelled (200; the worker skips it). A running job is stopped within one
    decoding step (202; it ends `cancelled` with the text generated so far). A finished job's
    record and activations are deleted (204)."""
    record, answer = _cancel(services, job_id, caller, operator, request, response, "DELETE /jobs/{id}")
    if answer is not None:
        return answer
    services.store.delete_prefix(job_prefix(job_id))
    services.jobs.delete(record)
    return Response(status_code=204)


@router.post(
    "/{job_id}/cancel",
    status_code=200,
    response_model=JobView,
    responses={**ERRORS, 202: {"description": "Cancelling"}, 409: {"description": "Already finished"}},
)
def cancel_job(
    job_id: str, services: ServicesDep, caller: CallerDep, operator: SeesAllDep, request: Request, response: Response
) -> JobView:
    """Cancel a job, never delete it: a queued job becomes `cancelled` (200; the worker skips it),
    a running job is stopped within one decoding step (202; it ends `cancelled` with the text
    generated so far). A finished job is left as it is: 409 naming its state (DELETE would
    delete it). `actq cancel --run LABEL` calls it for each unfinished job of a run."""
    record, answer = _cancel(services, job_id, caller, operator, request, response, "POST /jobs/{id}/cancel")
    if answer is not None:
        return answer
    raise Conflict(f"job {job_id} already ended {record.status.value}: there is nothing to cancel")


def _cancel(
    services: Services,
    job_id: str,
    caller: str | None,
    operator: bool,
    request: Request,
    response: Response,
    by: str,
) -> tuple[JobRecord, JobView | None]:
    """Cancel `job_id` if it has not ended: a queued job's view (it is `cancelled`), or a running
    job's (202: it stops within one decoding step, and its outcome, if recorded after this, is
    `cancelled`). Otherwise its record and None. Each step is a transaction with its check, so a
    job that moved on meanwhile (queued -> running -> ended) is looked at again as it is now."""
    for _ in range(5):
        record = load(services, job_id, caller)
        if record.status is JobStatus.queued:
            cancelled = services.jobs.cancel_queued(job_id, JobCancelled(f"cancelled by {by} before it ran"))
            if cancelled is not None:
                return cancelled, view(cancelled, request)
        elif record.status is JobStatus.running:
            if services.jobs.request_cancel(job_id):
                response.status_code = 202
                return record, view(record, request, _shown(services.jobs.live_fields(record), operator))
        else:
            return record, None
    raise Conflict(f"job {job_id} kept changing state while it was being cancelled: try again")


def _shown(live: dict[str, int | None], operator: bool) -> dict[str, int | None]:
    """A queue position counts other keys' jobs: with API keys on, only operators see it."""
    return live if operator else {k: v for k, v in live.items() if k != "queue_position"}

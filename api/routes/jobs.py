"""Jobs: submit, read, download."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from api.deps import CallerDep, ServicesDep, get_caller
from api.submit import submit, submit_batch, submit_now
from api.waiting import wait_for_job
from shared import keys
from shared.errors import JobNotFound, NotReady, TensorNotFound
from shared.jobs import now
from shared.safetensors_io import parse_rows, read_tensor
from shared.schemas import BatchItem, BatchRequest, BatchResponse, JobError, JobRecord, JobRequest, JobStatus, JobView
from shared.storage import job_prefix

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(get_caller)])
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
ERRORS = {404: {"description": "No such job"}}
CANCELLED = JobError(type="cancelled", message="cancelled by DELETE /jobs/{id} before it ran")


def load(services, job_id: str, caller: str | None) -> JobRecord:
    """Job ids are uuid4s; anything else is unknown without touching Redis or the disk. With API
    keys, another key's job is unknown too (404, not 403: its existence is not disclosed)."""
    return _visible(services, job_id, caller, services.jobs.get(job_id) if _UUID.fullmatch(job_id) else None)


async def load_async(services, job_id: str, caller: str | None) -> JobRecord:
    """`load` on the event loop (redis.asyncio): the hot path of polling clients."""
    raw = await services.aredis.get(keys.job(job_id)) if _UUID.fullmatch(job_id) else None
    return _visible(services, job_id, caller, None if raw is None else JobRecord.model_validate_json(raw))


def _visible(services, job_id: str, caller: str | None, record: JobRecord | None) -> JobRecord:
    if record is None or (services.settings.api_key_list and record.owner != caller):
        raise JobNotFound(f"no job with id {job_id!r}")
    return record


def view(record: JobRecord, request: Request, live: dict | None = None) -> JobView:
    """The public shape of a record; `live` adds queue_position / generated_tokens."""
    data = record.model_dump(include=set(JobView.model_fields))
    data.update(live or {})
    if record.activations is not None:
        data["activations"]["download_url"] = str(request.url_for("download_activations", job_id=record.id))
    return JobView.model_validate(data)


@router.post("", status_code=202, response_model=JobView, responses={404: {"description": "Unknown model"}, 422: {}, 503: {}})
async def create_job(
    body: JobRequest,
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> JobView:
    """Queue a chat completion with activation capture."""
    if idempotency_key is None:
        record, created = await submit_now(services, body, owner=caller), True
    else:  # may wait for a concurrent request with the same key: off the event loop
        record, created = await run_in_threadpool(submit, services, body, idempotency_key, caller)
    response.headers["Location"] = str(request.url_for("get_job", job_id=record.id))
    if not created:
        response.status_code = 200
    return view(record, request)


@router.post("/batch", status_code=202, response_model=BatchResponse, responses={404: {"description": "Unknown model"}, 409: {}, 422: {}, 503: {}})
def create_jobs(body: BatchRequest, services: ServicesDep, caller: CallerDep) -> BatchResponse:
    """Queue many jobs at once: all are validated first; one bad entry rejects the batch (its index
    is in the message) and nothing is queued. Entries may carry an idempotency_key."""
    results = submit_batch(services, body.jobs, owner=caller)
    return BatchResponse(jobs=[BatchItem(id=r.id, status=r.status.value, created=created) for r, created in results])


@router.get("", response_model=list[JobView])
def list_jobs(
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    status: JobStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> list[JobView]:
    """The caller's jobs, newest first (with API keys, only the jobs made with the caller's key)."""
    index = keys.jobs_index(caller)
    views: list[JobView] = []
    start = 0
    while len(views) < limit:
        ids = [i.decode() for i in services.redis.zrevrange(index, start, start + 4 * limit - 1)]
        if not ids:
            break
        start += len(ids)
        raws = services.redis.mget([keys.job(i) for i in ids])
        expired = [i for i, raw in zip(ids, raws) if raw is None]
        if expired:  # records past their retention leave the index too
            services.redis.zrem(index, *expired)
            start -= len(expired)
        for raw in raws:
            if raw is None:
                continue
            record = JobRecord.model_validate_json(raw)
            if status is None or record.status is status:
                views.append(view(record, request))
    return views[:limit]


@router.get("/{job_id}", response_model=JobView, responses=ERRORS)
async def get_job(
    job_id: str,
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    wait: Annotated[float, Query(ge=0, le=60, description="Seconds to wait for the job to finish (long poll).")] = 0,
) -> JobView:
    """A job's status, and its result and activations manifest once it has succeeded. With `wait`,
    the answer comes as soon as the job finishes (or after `wait` seconds), instead of polling."""
    record = await load_async(services, job_id, caller)
    if wait > 0 and not record.status.terminal:
        record = await wait_for_job(services.aredis, job_id, wait) or record
    live = {}
    if record.status is JobStatus.queued:
        live = _queue_position(await services.aredis.zrank(keys.queued(record.model), record.id))
    elif record.status is JobStatus.running:
        live = _progress(await services.aredis.get(keys.progress(record.id)))
    return view(record, request, live)


def _queue_position(rank: int | None) -> dict:
    return {"queue_position": None if rank is None else rank + 1}


def _progress(tokens: bytes | None) -> dict:
    return {"generated_tokens": int(tokens) if tokens is not None else 0}


def live_fields(services, record: JobRecord) -> dict:
    """Where a queued job stands in its model's queue; how far a running job has got."""
    if record.status is JobStatus.queued:
        return _queue_position(services.redis.zrank(keys.queued(record.model), record.id))
    if record.status is JobStatus.running:
        return _progress(services.redis.get(keys.progress(record.id)))
    return {}


def _artifacts(services, job_id: str, caller: str | None) -> JobRecord:
    record = load(services, job_id, caller)
    if record.status is not JobStatus.succeeded:
        raise NotReady(f"job {job_id} is {record.status.value}; activations exist once it has succeeded")
    if record.activations is None:
        raise JobNotFound(f"job {job_id} captured no activations (its request had no capture spec)")
    return record


@router.get("/{job_id}/activations", responses={**ERRORS, 307: {"description": "S3: presigned URL"}, 409: {"description": "Not ready"}})
def download_activations(job_id: str, services: ServicesDep, caller: CallerDep, proxy: bool = False) -> Response:
    """The job's safetensors file: streamed (local store, or S3 with proxy=true; HTTP Range
    supported on the local store), or a 307 redirect to a presigned S3 URL."""
    record = _artifacts(services, job_id, caller)
    manifest = record.activations
    headers = {"etag": f'"{manifest.sha256}"', "content-disposition": f'attachment; filename="{job_id}.safetensors"'}
    path = services.store.local_path(manifest.key)
    if path is not None:
        if not path.is_file():
            raise JobNotFound(f"the activations of job {job_id} are no longer in the store")
        return FileResponse(path, media_type="application/octet-stream", headers=headers)
    if not proxy:
        url = services.store.presigned_url(manifest.key, services.settings.presign_expiry_seconds)
        return RedirectResponse(url, status_code=307)
    headers["content-length"] = str(manifest.bytes)
    return StreamingResponse(services.store.stream(manifest.key), media_type="application/octet-stream", headers=headers)


@router.get("/{job_id}/activations/{name}", responses={**ERRORS, 409: {"description": "Not ready"}})
def download_tensor(
    job_id: str,
    name: str,
    services: ServicesDep,
    caller: CallerDep,
    rows: Annotated[str | None, Query(description="start:stop, a slice of the first dimension", max_length=40)] = None,
) -> Response:
    """One tensor as a small safetensors file, read through the header's byte offsets."""
    record = _artifacts(services, job_id, caller)
    known = {t.name for t in record.activations.tensors} | {"token_ids"}
    if name not in known:
        raise TensorNotFound(f"no tensor named {name!r} in job {job_id}; tensors: {', '.join(sorted(known))}")
    data = read_tensor(services.store, record.activations.key, name, parse_rows(rows))
    return Response(data, media_type="application/octet-stream")


@router.delete("/{job_id}", status_code=200, response_model=JobView, responses={**ERRORS, 202: {"description": "Cancelling"}, 204: {"description": "Deleted"}})
def delete_job(job_id: str, services: ServicesDep, caller: CallerDep, request: Request, response: Response) -> Response | JobView:
    """A queued job is cancelled (200; the worker skips it). A running job is stopped within one
    decoding step (202; it ends `cancelled` with the text generated so far). A finished job's
    record and activations are deleted (204)."""
    record = load(services, job_id, caller)
    if record.status is JobStatus.queued:
        cancelled = services.jobs.update(
            job_id, lambda r: r.model_copy(update={"status": JobStatus.cancelled, "finished_at": now(), "error": CANCELLED}) if r.status is JobStatus.queued else None
        )
        if cancelled is not None:
            services.redis.zrem(keys.queued(record.model), job_id)
            return view(cancelled, request)
        record = load(services, job_id, caller)
    if record.status is JobStatus.running:
        services.redis.set(keys.cancel(job_id), 1, ex=services.settings.job_retention_seconds)
        response.status_code = 202
        return view(record, request, live_fields(services, record))
    services.store.delete_prefix(job_prefix(job_id))
    services.jobs.delete(job_id)
    services.redis.delete(keys.cancel(job_id), keys.progress(job_id))
    services.redis.zrem(keys.jobs_index(caller), job_id)
    return Response(status_code=204)

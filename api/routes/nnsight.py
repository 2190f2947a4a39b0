"""nnsight 0.8's remote protocol, so that a researcher's unchanged script with `remote=True` and
NDIF_HOST pointed here runs on the worker's model (docs/nnsight.md):

    WS   /subscribe              the client's first call: its session id, then its jobs' statuses
    POST /request                the payload (multipart: `data` envelope, `blob`), queued as a job
    GET  /response/{id}          a job's latest status (nnsight's non-blocking mode polls it)
    GET  /nnsight/results/{t}    the saves, by an unguessable expiring link (the client sends no key)
    GET  /jobs/{id}/nnsight-result   the same with the caller's key, like every other result
    GET  /status, /env, /whoami  what nnsight.status(), nnsight's environment check and whoami read

Every route but the link, /status and /env needs a key in ACTQ_NNSIGHT_KEYS (api/nnsight_checks.py):
nnsight sends none to those two, which tell only what GET /health and a version check would. The
payload's declared size and serialization header are checked (shared/nnsight_payload.py); it is stored
as opaque bytes and only the worker loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import uuid
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from api import nnsight_checks as checks
from api import nnsight_identity
from api.deps import CallerDep, Services, ServicesDep, key_id, one_of
from api.enqueue import queued_record
from api.errors import actq_error
from api.limits import QuotaExceeded
from api.visibility import load_async
from shared import keys, nnsight_payload
from shared.errors import ActqError, BadRequest, JobNotFound, NotReady, PayloadTooLarge, Unauthorized
from shared.jobs import OverQuota
from shared.schemas import JobRecord, JobRequest, JobStatus, ModelInfo, NnsightCall
from shared.storage import legacy_nnsight_result_key, nnsight_request_key

router = APIRouter(tags=["nnsight"])
LINK_PREFIX = "/nnsight/results/"


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the nnsight payload is over {limit:,} bytes (ACTQ_NNSIGHT_MAX_REQUEST_BYTES): save and send less, or load "
        "large inputs from storage inside the trace"
    )


def _key(headers: Any) -> str | None:
    key = headers.get(checks.KEY_HEADER)
    if key:
        return str(key)
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def frame(
    job_id: str, status: str, description: str = "", data: str | None = None, meta: dict | None = None
) -> dict[str, Any]:
    """One status as nnsight's ResponseModel reads it (`meta`: what the run cost)."""
    return {"id": job_id, "status": status, "description": description, "data": data, "meta": meta}


async def _link(request: Request | WebSocket, services: Services, job_id: str) -> str:
    """The job's download link: one per job, however often its status is polled (each poll renews
    it), so that polling a finished job adds nothing to Redis."""
    redis, ttl, by_job = services.aredis, services.settings.nnsight_link_seconds, keys.nnsight_job_link(job_id)
    async with redis.pipeline(transaction=False) as pipe:  # the job's token: the first poll's, or this one
        pipe.set(by_job, secrets.token_urlsafe(32), ex=ttl, nx=True)
        pipe.get(by_job)
        _, given = await pipe.execute()
    token = given.decode() if isinstance(given, bytes) else str(given)
    async with redis.pipeline(transaction=False) as pipe:  # renewed, and the same link key again
        pipe.expire(by_job, ttl)
        pipe.set(keys.nnsight_link(token), job_id, ex=ttl)
        await pipe.execute()
    base = str(request.base_url).rstrip("/")
    if base.startswith("ws"):
        base = "http" + base[2:]
    return f"{base}{LINK_PREFIX}{token}"


async def status_frame(request: Request | WebSocket, services: Services, record: JobRecord) -> dict[str, Any]:
    """The job's lifecycle status now (LOG lines are sent apart)."""
    if record.status is JobStatus.queued:
        return frame(record.id, "QUEUED", "waiting for the model")
    if record.status is JobStatus.running:
        return frame(record.id, "RUNNING", f"running on worker {record.worker or ''}".strip())
    if record.status is JobStatus.succeeded:
        output = record.result.nnsight if record.result is not None else None
        meta = {"held_seconds": output.held_s, "result_bytes": output.bytes} if output is not None else None
        return frame(record.id, "COMPLETED", "done", await _link(request, services, record.id), meta)
    error = record.error
    described = f"{error.type}: {error.message}" if error is not None else record.status.value
    return frame(record.id, "ERROR", described)


# -- submitting ----------------------------------------------------------------------------


def _checked_digest(payload: bytes, compress: bool, limit: int) -> str:
    """The payload's sha256, once its declared size and serialization header pass (nnsight_payload.check)."""
    nnsight_payload.check(payload, compress, limit)
    return hashlib.sha256(payload).hexdigest()


@router.post("/request", responses={400: {}, 401: {}, 403: {}, 413: {}, 429: {}})
async def submit_request(request: Request, services: ServicesDep) -> JSONResponse:
    """nnsight's POST /request: check everything, store the payload, queue the job (RECEIVED)."""
    owner = checks.trusted_caller(services, _key(request.headers))  # before anything is read or stored
    limit = services.settings.nnsight_max_request_bytes
    async with request.form(max_files=1, max_fields=4, max_part_size=100_000) as form:
        data = form.get("data")
        blob = form.get("blob")
        envelope = checks.envelope(data if isinstance(data, str) else None)
        if not isinstance(blob, UploadFile):
            raise BadRequest("the form has no `blob` file: the payload nnsight's client serialised")
        info = await run_in_threadpool(checks.served_model, services, envelope.model_key)
        checks.check_versions(request.headers.get("nnsight-version"), request.headers.get("python-version"), info)
        checks.check_env(envelope.env, info)
        payload = await blob.read(limit + 1)
    if len(payload) > limit:
        raise too_large(limit)
    if not payload:
        raise BadRequest("the `blob` file is empty: send the payload nnsight's client serialised")
    # its declared size and serialization header, then its digest: on a thread (60 MB took the loop 287 ms)
    digest = await run_in_threadpool(_checked_digest, payload, envelope.compress, limit)
    job_id = str(uuid.uuid4())
    call = NnsightCall(
        model_key=envelope.model_key,
        sha256=digest,
        bytes=len(payload),
        compress=envelope.compress,
        nnsight_version=(request.headers.get("nnsight-version") or "")[:100],
        python_version=(request.headers.get("python-version") or "")[:300],
        session_id=envelope.session_id[:100] or None,
        caller=owner,
    )
    record = queued_record(job_id, JobRequest(model=info.name, mode="nnsight", nnsight=call), (0, [], 0, []), owner)
    key = nnsight_request_key(job_id)
    await run_in_threadpool(services.store.put_bytes, key, payload)
    try:
        limits = services.settings.max_queued_jobs_per_key, services.settings.max_queued_bytes_per_key
        await services.jobs.enqueue_async(record, services.celery, 0, limits)
    except BaseException as exc:
        await run_in_threadpool(services.store.delete_prefix, key)
        if isinstance(exc, OverQuota):
            raise QuotaExceeded(exc.message) from None
        raise
    if call.session_id:
        session = keys.nnsight_session(owner, call.session_id)
        async with services.aredis.pipeline(transaction=False) as pipe:
            pipe.rpush(session, job_id)
            pipe.expire(session, 24 * 3600)
            pipe.publish(keys.job_events(session), "job")
            await pipe.execute()
    return JSONResponse(frame(job_id, "RECEIVED", f"queued for {info.name}"))


# -- statuses ------------------------------------------------------------------------------


@router.get("/response/{job_id}", responses={401: {}, 403: {}, 404: {}})
async def get_response(job_id: str, request: Request, services: ServicesDep) -> JSONResponse:
    """A job's latest status, as nnsight's non-blocking mode polls it."""
    owner = checks.trusted_caller(services, _key(request.headers))
    record = await load_async(services, job_id, owner)
    if record.request.nnsight is None:
        raise JobNotFound(f"job {job_id} is not an nnsight job; read it at GET /jobs/{job_id}")
    return JSONResponse(await status_frame(request, services, record))


@router.websocket("/subscribe")
async def subscribe(websocket: WebSocket) -> None:
    """The session: its id first, then every status of the jobs sent with it, LOG lines included,
    until the client closes the socket."""
    services: Services = websocket.app.state.services
    async with contextlib.AsyncExitStack() as held:
        try:
            owner = checks.trusted_caller(services, _key(websocket.headers))
            await held.enter_async_context(services.waiters.slot(owner))  # a long poll's place, before the id
        except ActqError as exc:
            await _deny(websocket, exc)
            return
        await _session(websocket, services, owner)


async def _deny(websocket: WebSocket, exc: ActqError) -> None:
    """Refuse a socket before accepting it: the HTTP refusal itself, where the server can send
    one (uvicorn can), else a policy close that says why."""
    denial = await actq_error(websocket, exc)  # type: ignore[arg-type]  # it reads nothing of the request
    try:
        await websocket.send_denial_response(denial)
    except RuntimeError:
        await websocket.close(code=1008, reason=exc.message[:120])


async def _session(websocket: WebSocket, services: Services, owner: str | None) -> None:
    session = uuid.uuid4().hex
    await websocket.accept()
    await websocket.send_json({"session_id": session})
    closed = asyncio.ensure_future(websocket.receive())  # the client's close (it sends nothing else)
    try:
        async with services.waiters.watch() as watch:
            sent_with = keys.nnsight_session(owner, session)
            listed = 0  # how many of the session's jobs have been read from its list
            jobs: dict[str, tuple[str, int]] = {}  # unfinished job id -> (last status sent, LOG lines sent)
            while not closed.done():
                watch.clear()
                watch.add(sent_with)
                for raw in await services.aredis.lrange(sent_with, listed, listed + 999):  # the new ones
                    listed += 1
                    jobs.setdefault(raw.decode() if isinstance(raw, bytes) else str(raw), ("RECEIVED", 0))
                for job_id, (sent, lines) in list(jobs.items()):
                    jobs[job_id] = news = await _send_news(websocket, services, job_id, owner, sent, lines)
                    if news[0] in ("COMPLETED", "ERROR"):
                        del jobs[job_id]
                    else:
                        watch.add(job_id)
                await watch.wait(60, closed)
    except WebSocketDisconnect:
        pass
    finally:
        closed.cancel()
        with contextlib.suppress(Exception):
            await websocket.close()


async def _send_news(
    websocket: WebSocket, services: Services, job_id: str, owner: str | None, sent: str, lines: int
) -> tuple[str, int]:
    """What happened to the job since (`sent`, `lines`): new LOG lines, then its status if it changed."""
    try:
        record = await load_async(services, job_id, owner)
    except JobNotFound:
        await websocket.send_json(frame(job_id, "ERROR", f"job {job_id} is gone (deleted or expired)"))
        return "ERROR", lines
    printed = await services.aredis.lrange(keys.nnsight_log(job_id), lines, lines + 999)
    for line in printed:
        await websocket.send_json(frame(job_id, "LOG", line.decode() if isinstance(line, bytes) else str(line)))
    lines += len(printed)
    current = await status_frame(websocket, services, record)
    if current["status"] != sent:
        await websocket.send_json(current)
    return current["status"], lines


# -- results -------------------------------------------------------------------------------


def _result_response(services: ServicesDep, record: JobRecord) -> Response:
    if record.request.nnsight is None:
        raise JobNotFound(f"job {record.id} is not an nnsight job")
    if record.status is not JobStatus.succeeded or record.result is None or record.result.nnsight is None:
        raise NotReady(f"job {record.id} is {record.status.value}: its result exists once it succeeded")
    # the attempt that ran it wrote the saves where its result says; older records say nothing
    key = record.result.nnsight.key or legacy_nnsight_result_key(record.id)
    path = services.store.local_path(key)
    if path is not None:
        return FileResponse(path, media_type="application/octet-stream")
    return StreamingResponse(
        services.store.stream(key),
        media_type="application/octet-stream",
        headers={"Content-Length": str(record.result.nnsight.bytes)},
    )


@router.get(LINK_PREFIX + "{token}", responses={404: {}})
async def download_by_link(token: str, services: ServicesDep) -> Response:
    """The saves, by the link a COMPLETED status carries (no key: the link is the credential)."""
    job_id = await services.aredis.get(keys.nnsight_link(token)) if len(token) < 100 else None
    if job_id is None:
        raise JobNotFound("no such result link (it expired, or was never given out)")
    record = await services.jobs.get_async(job_id.decode() if isinstance(job_id, bytes) else str(job_id))
    if record is None:
        raise JobNotFound("the job of this link is gone (deleted or expired)")
    return _result_response(services, record)


@router.get("/jobs/{job_id}/nnsight-result", responses={401: {}, 404: {}, 409: {}})
async def download_result(job_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """An nnsight job's saves (`torch.save`, zstd when its client asked), with the caller's key."""
    return _result_response(services, await load_async(services, job_id, caller))


# -- what nnsight's helpers read -----------------------------------------------------------


def _served_names(services: Services) -> list[ModelInfo]:
    return [i for n in services.registry.names() if (i := services.registry.get(n))]


@router.get("/status", responses={403: {}})
async def ndif_status(services: ServicesDep) -> dict[str, Any]:
    """nnsight.status(), which sends no key: the served models by the repo id a client names them
    with (api/nnsight_identity.py) and whether a worker runs them, as NDIF lists its deployments;
    no more than GET /health tells (no folder paths). 403 while nnsight jobs are off."""
    checks.nnsight_on(services)
    infos = await run_in_threadpool(_served_names, services)
    counts = await services.registry.live_counts_async()
    deployments = {}
    for info in infos:
        repo = info.name if nnsight_identity.looks_like_path(info.source) else info.source
        deployments[info.name] = {
            "model_key": f"{checks.CLASSES[0]}:" + json.dumps({"repo_id": repo, "revision": None}),
            "repo_id": repo,
            "revision": "main",
            "task": "text-generation",
            "deployment_level": "HOT",
            "application_state": "RUNNING" if counts.get(info.name) else "NOT_STARTED",
        }
    return {"deployments": deployments}


@router.get("/env", responses={403: {}})
async def ndif_env(services: ServicesDep) -> dict[str, Any]:
    """nnsight's environment check (nnsight.compare(), which sends no key): the workers' Python and
    their nnsight, torch and transformers versions, what a payload must match. 403 while nnsight jobs are off."""
    checks.nnsight_on(services)
    infos = await run_in_threadpool(_served_names, services)
    info = next((i for i in infos if i.nnsight_version), None)
    if info is None:
        return {"python_version": None, "packages": {}}
    return {"python_version": info.python_version, "packages": info.packages or {"nnsight": info.nnsight_version}}


@router.get("/whoami")
async def whoami(request: Request, services: ServicesDep) -> dict[str, Any]:
    """nnsight.whoami(): no e-mail is kept; the tags say whether the key may run nnsight code.
    Only for a valid key (401 otherwise)."""
    key = _key(request.headers)
    settings = services.settings
    if key is None or not one_of(key, settings.api_key_list):
        raise Unauthorized("send a valid API key (`ndif-api-key` header, or `Authorization: Bearer`)")
    trusted = bool(settings.nnsight_key_list) and one_of(key, settings.nnsight_key_list)
    return {"email": None, "tags": ["nnsight"] if trusted else [], "key_id": key_id(key)}

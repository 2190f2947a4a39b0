"""Liveness, readiness and health.

- `GET /livez`: the API process is up and its event loop answers. Checks nothing else: 200 while
  Redis or the store is down (restarting the process would not bring them back). Kubernetes'
  livenessProbe.
- `GET /readyz`: this API can take and serve jobs: Redis (the job store and the broker: every
  `POST /jobs` and `GET /jobs/{id}` needs it) answers a PING; 503 when it does not. Neither the
  artifact store (jobs are accepted and read without it; only downloads and nnsight payloads need
  it, and they fail with their own error) nor live workers (jobs wait in their queue for one) is
  checked. Kubernetes' readinessProbe.
- `GET /health`: the whole picture for people and dashboards, as before: Redis, the artifact
  store (`low` when a local store has less than ACTQ_STORAGE_MIN_FREE_BYTES free), live workers
  per model, queued jobs for operators; 503 when Redis or the store cannot be used.
"""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api.deps import SeesAllDep, ServicesDep
from shared.errors import StorageError

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez() -> dict[str, str]:
    """The API process is up and serving (nothing else is checked)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(services: ServicesDep) -> JSONResponse:
    """Redis answers a PING: jobs can be accepted and read (503 naming Redis when not)."""
    try:
        await services.aredis.ping()
    except redis.RedisError as exc:
        return JSONResponse(
            {
                "error": "service_unavailable",
                "detail": "Redis cannot be reached: jobs can be neither accepted nor read",
                "status": "unavailable",
                "redis": f"unreachable: {type(exc).__name__}",
            },
            status_code=503,
        )
    return JSONResponse({"status": "ready", "redis": "ok"})


@router.get("/health")
async def health(services: ServicesDep, operator: SeesAllDep) -> JSONResponse:
    """API up, Redis and the artifact store reachable, live workers per model (and, for operators
    when API keys are on, queued jobs per model); 503 when Redis or the store cannot be used,
    `degraded` (200) when a local store is low on space. On the event loop, in a few round trips:
    it stays fast while the API is busy."""
    try:
        workers = await services.registry.live_counts_async()
        queued = await services.jobs.queue_depths_async(list(workers)) if operator else {}
    except redis.RedisError as exc:
        body: dict[str, object] = {"status": "unavailable", "redis": f"unreachable: {type(exc).__name__}"}
        return JSONResponse(
            {"error": "service_unavailable", "detail": "Redis cannot be reached", **body}, status_code=503
        )
    free = None
    try:
        if services.store.remote:  # a network call: off the event loop
            await run_in_threadpool(services.store.check)
        else:
            services.store.check()
            free = services.store.free_bytes()  # one statfs
        storage = "ok"
    except StorageError as exc:
        storage = exc.message
    status = "ok" if storage == "ok" else "unavailable"
    least = services.settings.storage_min_free_bytes
    if status == "ok" and free is not None and free < least:
        storage, status = f"low: {free} bytes free, under ACTQ_STORAGE_MIN_FREE_BYTES ({least})", "degraded"
    body = {
        "status": status,
        "redis": "ok",
        "storage": storage,
        **({"storage_free_bytes": free} if free is not None else {}),
        "workers": workers,
        **({"queued": queued} if operator else {}),
    }
    if status == "unavailable":
        body = {"error": "service_unavailable", "detail": f"the artifact store cannot be used: {storage}", **body}
    return JSONResponse(body, status_code=503 if status == "unavailable" else 200)

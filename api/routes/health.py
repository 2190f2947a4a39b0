"""Liveness and readiness."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from api.deps import SeesAllDep, ServicesDep
from shared.errors import StorageError

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(services: ServicesDep, operator: SeesAllDep) -> JSONResponse:
    """API up, Redis and the artifact store reachable, live workers per model (and, for operators
    when API keys are on, queued jobs per model); 503 when Redis or the store cannot be used.
    On the event loop, in a few round trips: it stays fast while the API is busy."""
    try:
        workers = await services.registry.live_counts_async()
        queued = await services.jobs.queue_depths_async(list(workers)) if operator else {}
    except redis.RedisError as exc:
        body: dict[str, object] = {"status": "unavailable", "redis": f"unreachable: {type(exc).__name__}"}
        return JSONResponse(
            {"error": "service_unavailable", "detail": "Redis cannot be reached", **body}, status_code=503
        )
    try:
        if services.store.remote:  # a network call: off the event loop
            await run_in_threadpool(services.store.check)
        else:
            services.store.check()
        storage = "ok"
    except StorageError as exc:
        storage = exc.message
    body = {
        "status": "ok" if storage == "ok" else "unavailable",
        "redis": "ok",
        "storage": storage,
        "workers": workers,
        **({"queued": queued} if operator else {}),
    }
    if storage != "ok":
        body = {"error": "service_unavailable", "detail": f"the artifact store cannot be used: {storage}", **body}
    return JSONResponse(body, status_code=200 if storage == "ok" else 503)

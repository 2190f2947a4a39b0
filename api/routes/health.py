"""Liveness and readiness."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import SeesAllDep, ServicesDep
from shared.errors import StorageError

router = APIRouter(tags=["health"])


@router.get("/health")
def health(services: ServicesDep, operator: SeesAllDep) -> JSONResponse:
    """API up, Redis and the artifact store reachable, live workers per model (and, for operators
    when API keys are on, queued jobs per model); 503 when Redis or the store cannot be used."""
    try:
        services.redis.ping()
        names = services.registry.names()
        workers = {name: len(services.registry.live_workers(name)) for name in names}
        queued = {name: services.jobs.queue_depth(name) for name in names}
    except redis.RedisError as exc:
        body: dict[str, object] = {"status": "unavailable", "redis": f"unreachable: {type(exc).__name__}"}
        return JSONResponse(
            {"error": "service_unavailable", "detail": "Redis cannot be reached", **body}, status_code=503
        )
    try:
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

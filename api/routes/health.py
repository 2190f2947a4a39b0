"""Liveness and readiness."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/health")
def health(services: ServicesDep) -> JSONResponse:
    """API up, Redis reachable, live workers per model; 503 when Redis is unreachable."""
    try:
        services.redis.ping()
        workers = {name: len(services.registry.live_workers(name)) for name in services.registry.names()}
    except redis.RedisError as exc:
        return JSONResponse({"status": "unavailable", "redis": f"unreachable: {type(exc).__name__}"}, status_code=503)
    return JSONResponse({"status": "ok", "redis": "ok", "workers": workers})

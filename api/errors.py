"""One handler per error family: every error body is {"error": <type>, "detail": <what to fix>}."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import HTTPExceptionHandler

from shared.errors import ActqError, Busy
from shared.outages import REDIS, outage
from shared.redis_faults import refusal

log = logging.getLogger("actq.api")


def _body(error: str, detail: str, **extra: object) -> dict:
    return {"error": error, "detail": detail, **extra}


def where(loc: tuple[object, ...]) -> str:
    """Where in the request a validation error is, as a dotted path (`messages.0.role`)."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


async def actq_error(_: Request, exc: ActqError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else {}
    if isinstance(exc, Busy):
        headers["Retry-After"] = str(exc.retry_after)
    body = _body(exc.error_type, exc.message, **exc.extra())
    return JSONResponse(body, status_code=exc.status_code, headers=headers or None)


BODY_DEPTH = 200  # pydantic's JSON parser refuses a body nested deeper (api/bodies.py parses with it)


def invalid_json(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """What is wrong with a body that did not parse as JSON, or None when it did."""
    bad = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad is None:
        return None
    reason = str(bad.get("msg", "")).removeprefix("Invalid JSON: ")
    if "recursion limit" in reason:
        return (
            f"the request body nests objects and arrays more than {BODY_DEPTH} levels deep ({reason}); "
            "send a flatter body"
        )
    return f"the request body is not valid JSON ({reason})"


async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if (problem := invalid_json(errors)) is not None:
        return JSONResponse(_body("invalid_json", problem), status_code=400)
    messages = [f"{where(tuple(e.get('loc', ())))}: {e.get('msg')}" for e in errors]
    details = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg"), "type": e.get("type")} for e in errors]
    return JSONResponse(_body("invalid_request", "; ".join(messages), errors=details), status_code=422)


async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return JSONResponse(_body(kind, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)


POOL_EXHAUSTED = "No connection available."  # redis-py's BlockingConnectionPool, when its wait runs out


def redis_trouble(exc: Exception) -> str:
    """What is wrong with Redis, for a 503: it refuses writes (naming why: MISCONF, OOM, READONLY),
    it cannot be reached, or it answered an error."""
    refused = refusal(exc)
    if refused is not None:
        return (
            f"Redis (the job store and broker) refuses writes: {refused}; nothing was changed, "
            "try again once it accepts writes"
        )
    if isinstance(exc, redis.ConnectionError) and str(exc) == POOL_EXHAUSTED:
        return (
            "this API process is busy: all its Redis connections (ACTQ_REDIS_MAX_CONNECTIONS) stayed in use for 5 s; "
            "Redis itself is reachable; try again shortly"
        )
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return "Redis (the job store and broker) cannot be reached; try again shortly"
    return f"Redis (the job store and broker) answered an error: {exc}"


_probes: set[asyncio.Task[None]] = set()  # the running outage probe (kept: the loop holds tasks weakly)


async def _until_back(client: aioredis.Redis, every: float = 1.0) -> None:
    """PING Redis every `every` seconds until it answers: then the outage has ended (logged once)."""
    while True:
        await asyncio.sleep(every)
        try:
            await client.ping()
        except redis.RedisError:
            continue
        outage(REDIS).ok()
        return


async def unavailable(request: Request, exc: Exception) -> JSONResponse:
    busy = isinstance(exc, redis.ConnectionError) and str(exc) == POOL_EXHAUSTED
    if busy:
        log.warning("backend unavailable: %s", exc)
    elif outage(REDIS).failed(exc):  # the first 503 of an outage: logged once, its end found by a probe
        probe = asyncio.get_running_loop().create_task(_until_back(request.app.state.services.aredis))
        _probes.add(probe)
        probe.add_done_callback(_probes.discard)
    headers = {"Retry-After": "1"} if busy else None
    return JSONResponse(_body("service_unavailable", redis_trouble(exc)), status_code=503, headers=headers)


def install(app: FastAPI) -> None:
    # Starlette types every handler as taking Exception; it calls each with its own class only
    app.add_exception_handler(ActqError, cast(HTTPExceptionHandler, actq_error))
    app.add_exception_handler(RequestValidationError, cast(HTTPExceptionHandler, validation_error))
    app.add_exception_handler(HTTPException, cast(HTTPExceptionHandler, http_error))
    app.add_exception_handler(redis.RedisError, unavailable)

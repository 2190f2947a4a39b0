"""Per-process objects the routes use, built once by the app factory and reached as dependencies."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

import redis
import redis.asyncio as aioredis
from celery import Celery
from fastapi import Depends, Request

from api.check_pool import CheckPool
from api.waiters import JobWaiters
from shared.broker import make_celery
from shared.errors import Forbidden, Unauthorized
from shared.idempotency import IdempotencyKeys
from shared.jobs import JobStore
from shared.registry import ModelRegistry
from shared.settings import Settings
from shared.storage import ArtifactStore, open_store


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    aredis: aioredis.Redis  # for the reads on the event loop (GET /jobs/{id}, long polls, POST /jobs)
    jobs: JobStore
    waiters: JobWaiters  # long polls, on one subscription per process
    idempotency: IdempotencyKeys
    registry: ModelRegistry
    celery: Celery
    store: ArtifactStore
    checks: CheckPool  # schema and grammar checks, on threads, fairly per key


def build_services(settings: Settings) -> Services:
    """Nothing here connects yet: redis-py connects on first use. The Celery app only builds
    messages (shared/broker.py); the API never opens a broker connection of its own."""
    client = redis.Redis.from_url(
        settings.redis_url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30
    )
    # A blocking pool: under a burst a request waits (up to 5 s) for a free connection instead of
    # failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_max_connections, timeout=5, socket_connect_timeout=2
    )
    aclient = aioredis.Redis(connection_pool=pool)
    celery = make_celery(settings)
    jobs = JobStore(client, settings.job_retention_seconds, aclient=aclient, fair_share=settings.fair_share_jobs)
    return Services(
        settings=settings,
        redis=client,
        aredis=aclient,
        jobs=jobs,
        waiters=JobWaiters(
            aclient,
            jobs,
            settings.max_long_polls,
            settings.max_long_polls_per_key,
            reads=max(1, settings.redis_max_connections // 2),  # half the pool: the rest for everything else
        ),
        idempotency=IdempotencyKeys(client, jobs, settings.job_retention_seconds),
        registry=ModelRegistry(client, settings.heartbeat_ttl, cache_seconds=1.0, aclient=aclient),
        celery=celery,
        store=open_store(settings),
        checks=CheckPool(settings.content_checks_per_key, settings.content_check_threads),
    )


async def get_services(request: Request) -> Services:  # async: no threadpool hop for a lookup
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def one_of(token: str, keys: list[str]) -> bool:
    matched = False
    for key in keys:  # no early exit: the time taken does not tell which key matched
        matched |= hmac.compare_digest(token.encode(), key.encode())
    return matched


async def get_caller(request: Request, services: ServicesDep) -> str | None:
    """Who is calling: None when no keys are set (ACTQ_API_KEYS, ACTQ_OPERATOR_KEYS); else a
    stable id of the caller's key (the key itself is never stored). Compared in constant time."""
    keys = services.settings.api_key_list
    if not keys:
        return None
    token = _bearer(request)
    if token is None:
        raise Unauthorized("this API needs a key: send `Authorization: Bearer <key>`")
    if not one_of(token, keys):
        raise Unauthorized("the API key is not valid")
    return key_id(token)


def key_id(key: str) -> str:
    """The stable id of an API key, which its jobs are stored under (the key itself never is)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


CallerDep = Annotated[str | None, Depends(get_caller)]


async def sees_all(request: Request, services: ServicesDep) -> bool:
    """Whether the caller may see counts across keys: always with keys off, else only with an
    operator key. Never raises: /health answers everyone, with less for non-operators."""
    if not services.settings.api_key_list:
        return True
    token = _bearer(request)
    return token is not None and one_of(token, services.settings.operator_key_list)


SeesAllDep = Annotated[bool, Depends(sees_all)]


async def require_operator(caller: CallerDep, operator: SeesAllDep) -> None:
    """Operator-only routes: 401 without a valid key, 403 with a key that is not an operator's."""
    if not operator:
        raise Forbidden("this needs an operator key (ACTQ_OPERATOR_KEYS)")

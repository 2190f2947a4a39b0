"""Per-process objects the routes use, built once by the app factory and reached as dependencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis
import redis.asyncio as aioredis
from celery import Celery
from fastapi import Depends, Request

from shared.jobs import JobStore
from shared.queueing import make_celery
from shared.registry import ModelRegistry
from shared.settings import Settings
from shared.storage import ArtifactStore, open_store


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    aredis: aioredis.Redis  # for long polls only
    jobs: JobStore
    registry: ModelRegistry
    celery: Celery
    store: ArtifactStore


def build_services(settings: Settings) -> Services:
    """Nothing here connects yet: redis-py and Celery connect on first use."""
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30)
    celery = make_celery(settings)
    celery.conf.broker_connection_timeout = 2
    celery.conf.task_publish_retry_policy = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2}
    return Services(
        settings=settings,
        redis=client,
        aredis=aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=2),
        jobs=JobStore(client, settings.job_retention_seconds),
        registry=ModelRegistry(client, settings.heartbeat_ttl),
        celery=celery,
        store=open_store(settings),
    )


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]

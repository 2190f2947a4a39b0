"""The worker's job store (outage_seconds > 0) waits out Redis refusing writes (OOM here: a real
`maxmemory` under noeviction) as it waits out an outage, and records the outcome once writes are
allowed again; any other error reply is not retried."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from shared.broker import make_celery
from shared.errors import JobTimeout
from shared.jobs import JobStore
from shared.settings import Settings
from tests.shared.test_jobs import record


def test_a_refused_write_is_retried_until_redis_accepts_writes(redis_server, redis_client):
    store = JobStore(redis_client, retention_seconds=60, outage_seconds=20)
    job = record()
    store.enqueue([job], make_celery(Settings(redis_url=redis_server.url)))
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)
    lift = threading.Timer(1.5, redis_client.config_set, ("maxmemory", 0))
    started = time.monotonic()
    lift.start()
    try:
        failed = store.fail(job.id, JobTimeout("too slow"))
    finally:
        lift.join()
        redis_client.config_set("maxmemory", 0)
    assert failed is not None and failed.status.value == "failed"
    assert time.monotonic() - started >= 1.4
    assert store.get(job.id).status.value == "failed"  # type: ignore[union-attr]


def test_other_error_replies_are_not_retried(redis_client):
    store = JobStore(redis_client, retention_seconds=60, outage_seconds=20)
    redis_client.set("not-a-hash", "x")
    started = time.monotonic()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        store._through_outage(lambda: redis_client.hget("not-a-hash", "f"))
    assert time.monotonic() - started < 1

"""Per-key limits on queued jobs and their estimated capture bytes, on the real app and a real
Redis: beyond a limit POST /jobs, POST /jobs/batch and /v1/chat/completions answer 429 naming the
setting and queue nothing; a job gives its share back once, when it ends (also when its message
is delivered again), is cancelled, or its record expires while queued."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from shared import keys
from shared.errors import JobCancelled, WorkerLost
from shared.jobs import JobStore
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.support.models import tiny_llama
from tests.support.stack import TINY, job_count, queued_messages

JOB = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CAPTURE = {**JOB, "capture": {"modules": ["model.layers.1"]}}


@pytest.fixture
def app_with(settings: Settings, redis_client):
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    registry.publish(tiny_llama())
    registry.heartbeat(tiny_llama(), "test-worker")
    return lambda **changes: TestClient(create_app(settings.model_copy(update=changes)))


def store(settings: Settings, redis_client) -> JobStore:
    return JobStore(redis_client, settings.job_retention_seconds)


def test_queued_jobs_per_key_are_limited_and_given_back_once(app_with, settings, redis_client):
    with app_with(max_queued_jobs_per_key=3) as http:
        ids = [http.post("/jobs", json=JOB).json()["id"] for _ in range(2)]
        refused = http.post("/jobs/batch", json={"jobs": [{"request": JOB}] * 2})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"] == "quota_exceeded"
        assert "ACTQ_MAX_QUEUED_JOBS_PER_KEY" in refused.json()["detail"] and "nothing was queued" in refused.text
        assert job_count(redis_client) == 2 and queued_messages(redis_client, TINY) == 2
        ids.append(http.post("/jobs", headers={"Idempotency-Key": "k1"}, json=JOB).json()["id"])
        for response in (
            http.post("/jobs", json=JOB),
            http.post("/jobs", headers={"Idempotency-Key": "k2"}, json=JOB),
            http.post("/v1/chat/completions", json={**JOB, "max_tokens": 2}),
        ):
            assert response.status_code == 429, response.text
            assert "ACTQ_MAX_QUEUED_JOBS_PER_KEY" in response.text
        assert job_count(redis_client) == 3 and queued_messages(redis_client, TINY) == 3
        assert redis_client.get(keys.idempotency("k2")) is None  # the refused request's key is free again

        assert http.delete(f"/jobs/{ids[0]}").status_code in (200, 202)  # a cancelled queued job gives back
        jobs = store(settings, redis_client)
        jobs.fail(ids[1], WorkerLost("lost"))
        jobs.fail(ids[1], WorkerLost("lost again"))  # a second outcome (a redelivery) gives back nothing
        jobs.fail(ids[0], JobCancelled("again"))
        assert jobs.quota_used(None)[0] == 1
        assert [http.post("/jobs", json=JOB).status_code for _ in range(3)] == [202, 202, 429]
        assert jobs.quota_used(None)[0] == 3


def test_queued_bytes_per_key_are_limited(app_with, settings, redis_client):
    with app_with() as http:
        first = http.post("/jobs", json=CAPTURE)
        assert first.status_code == 202
    jobs = store(settings, redis_client)
    used = jobs.quota_used(None)
    assert used[0] == 1 and used[1] > 0  # the job's estimated capture bytes
    with app_with(max_queued_bytes_per_key=2 * used[1] - 1) as http:
        refused = http.post("/jobs", json=CAPTURE)
        assert refused.status_code == 429 and "ACTQ_MAX_QUEUED_BYTES_PER_KEY" in refused.json()["detail"]
        assert http.post("/jobs", json=JOB).status_code == 202  # no capture: no bytes
        jobs.fail(first.json()["id"], WorkerLost("lost"))
        assert jobs.quota_used(None) == (1, 0)
        assert http.post("/jobs", json=CAPTURE).status_code == 202


def test_each_key_has_its_own_limit_and_expired_jobs_give_theirs_back(app_with, redis_client):
    def bearer(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    with app_with(api_keys="key-a,key-b", max_queued_jobs_per_key=1) as http:
        gone = http.post("/jobs", json=JOB, headers=bearer("key-a")).json()["id"]
        assert http.post("/jobs", json=JOB, headers=bearer("key-a")).status_code == 429
        assert http.post("/jobs", json=JOB, headers=bearer("key-b")).status_code == 202
        redis_client.delete(keys.job(gone))  # its record expired while queued: it never ends
        assert http.post("/jobs", json=JOB, headers=bearer("key-a")).status_code == 202
        assert http.post("/jobs", json=JOB, headers=bearer("key-a")).status_code == 429

"""The Celery worker records a hard timeout (its engine was stopped for a job that would not end)
as the attempt the engine ran, on a real Redis: if another worker has claimed the job since (this
one looked lost), that attempt's outcome stands and the timeout is only logged."""

from __future__ import annotations

import uuid

import pytest

from shared.broker import make_celery
from shared.errors import JobTimeout
from shared.jobs import JobStore, now
from shared.schemas import JobRecord, JobRequest, JobStatus
from shared.settings import Settings


@pytest.fixture
def celery_app(redis_server, monkeypatch):
    from worker import celery_app

    monkeypatch.setattr(celery_app, "settings", Settings(redis_url=redis_server.url))
    monkeypatch.setattr(celery_app, "_stores", [])  # its job store, built again on this Redis
    return celery_app


def claimed_twice(redis_server, redis_client) -> tuple[JobStore, str]:
    jobs = JobStore(redis_client, retention_seconds=60)
    request = JobRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    record = JobRecord(
        id=str(uuid.uuid4()), status=JobStatus.queued, model="m", request=request, max_tokens=4, created_at=now()
    )
    jobs.enqueue([record], make_celery(Settings(redis_url=redis_server.url)))
    jobs.claim(record.id, "host:A", 3)
    jobs.claim(record.id, "host:B", 3)
    return jobs, record.id


def test_a_hard_timeout_of_a_stale_attempt_changes_nothing(celery_app, redis_server, redis_client, caplog):
    jobs, job_id = claimed_twice(redis_server, redis_client)
    celery_app._fail(job_id, JobTimeout("the job was stopped at the hard time limit of 5s"), (1, "host:A"))
    record = jobs.get(job_id)
    assert record.status is JobStatus.running and (record.attempts, record.worker) == (2, "host:B")
    assert "attempt 1 on host:A lost" in caplog.text and "its timeout is not recorded" in caplog.text
    celery_app._fail(job_id, JobTimeout("the job was stopped at the hard time limit of 5s"), (2, "host:B"))
    record = jobs.get(job_id)
    assert record.status is JobStatus.failed and record.error.type == "timeout"
    assert record.error.message == "the job was stopped at the hard time limit of 5s"

"""JobRecords in a real Redis: transitions, terminal states, redelivery and concurrent changes."""

from __future__ import annotations

import threading
import uuid

import pytest

from shared.jobs import JobStore, now
from shared.schemas import JobRecord, JobRequest, JobStatus


@pytest.fixture
def store(redis_client):
    store = JobStore(redis_client, retention_seconds=60)
    yield store
    # These records would expire a minute later, in the middle of another test's count of jobs.
    for key in redis_client.scan_iter(match="actq:job:*"):
        record = store.get(key.decode().rsplit(":", 1)[1])
        if record is not None and record.model == "m":
            redis_client.delete(key)


def new_job(store) -> str:
    job_id = str(uuid.uuid4())
    request = JobRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    store.create(JobRecord(id=job_id, status=JobStatus.queued, model="m", request=request, max_tokens=4, created_at=now()))
    return job_id


def test_lifecycle_and_retention(store, redis_client):
    job_id = new_job(store)
    assert 0 < redis_client.ttl(f"actq:job:{job_id}") <= 60
    record, why = store.claim(job_id, "w1", max_attempts=3)
    assert why == "claimed" and record.status is JobStatus.running and record.attempts == 1 and record.worker == "w1"
    done = store.finish(job_id, status=JobStatus.succeeded, result={"text": "x", "finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    assert done.status is JobStatus.succeeded and done.finished_at >= done.started_at
    assert 0 < redis_client.ttl(f"actq:job:{job_id}") <= 60  # the TTL survives updates


def test_a_terminal_job_is_never_run_or_changed_again(store):
    job_id = new_job(store)
    store.claim(job_id, "w1", 3)
    store.finish(job_id, status=JobStatus.succeeded)
    assert store.claim(job_id, "w2", 3) == (None, "already succeeded")
    assert store.finish(job_id, status=JobStatus.failed, error={"type": "x", "message": "y"}) is None
    assert store.get(job_id).status is JobStatus.succeeded
    assert store.claim(str(uuid.uuid4()), "w", 3) == (None, "unknown job")


def test_redelivery_counts_attempts_then_gives_up(store):
    job_id = new_job(store)
    for attempt in (1, 2):
        record, _ = store.claim(job_id, f"w{attempt}", max_attempts=2)
        assert record.attempts == attempt
    assert store.claim(job_id, "w3", max_attempts=2) == (None, "too many attempts")
    record = store.get(job_id)
    assert record.status is JobStatus.failed and record.error.type == "worker_lost"


def test_concurrent_claims_let_exactly_one_worker_run(store):
    job_id = new_job(store)
    store.claim(job_id, "first", 5)  # running, attempts=1
    store.finish(job_id, status=JobStatus.failed, error={"type": "t", "message": "m"})
    job_id = new_job(store)
    results = []
    barrier = threading.Barrier(8)

    def finish(i):
        barrier.wait()
        results.append(store.finish(job_id, status=JobStatus.cancelled) if i % 2 else store.claim(job_id, f"w{i}", 100)[0])

    threads = [threading.Thread(target=finish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = store.get(job_id)
    assert final.status is JobStatus.cancelled
    assert sum(1 for r in results if r is not None and r.status is JobStatus.cancelled) == 1

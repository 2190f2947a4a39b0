"""The runner's claim path (worker/engine/job_flow.py) with a real engine in this process (the tiny model)
over a real Redis: jobs delivered together are claimed in one transaction; a record a newer
version wrote, which this worker cannot read, is ended once with a readable error, and the jobs
claimed with it run as usual; a claim that raises is logged with its cause (never as KeyError
'record'), ends its own job once and never the others."""

from __future__ import annotations

import json
import logging
import threading
import uuid

import pytest

from shared import keys
from shared.broker import make_celery
from shared.jobs import now
from shared.schemas import JobRecord, JobRequest, JobStatus
from shared.settings import Settings
from worker.engine import job_flow, runtime

pytestmark = pytest.mark.model


@pytest.fixture
def rt(tiny_dir, redis_server, redis_client, tmp_path):
    settings = Settings(
        redis_url=redis_server.url,
        storage_url=(tmp_path / "data").as_uri(),
        model=str(tiny_dir),
        model_name="tiny",
        max_batch=4,
    )
    started = runtime.start(settings)
    yield started
    runtime.stop()


def _job() -> JobRecord:
    request = JobRequest(model="tiny", messages=[{"role": "user", "content": "Count to three."}])
    return JobRecord(
        id=str(uuid.uuid4()), status=JobStatus.queued, model="tiny", request=request, max_tokens=4, created_at=now()
    )


def test_an_unreadable_record_delivered_with_good_jobs_ends_once_and_they_run(rt, redis_client, caplog):
    jobs = [_job() for _ in range(4)]
    rt.jobs.enqueue(jobs, make_celery(rt.settings))
    bad = jobs[2].id
    stored = json.loads(redis_client.get(keys.job(bad)))
    stored["request"]["mode"] = "speculate"  # a mode a newer API accepts
    stored["written_by"] = "0.2.0"
    redis_client.set(keys.job(bad), json.dumps(stored), keepttl=True)

    answers: dict[str, str] = {}
    all_answered = threading.Event()

    def reply(job_id: str, outcome: str) -> None:
        answers[job_id] = outcome
        if len(answers) == len(jobs):
            all_answered.set()

    with caplog.at_level(logging.INFO):
        # delivered together
        job_flow._prepare_many(rt, [(job.id, reply, lambda *_: None, lambda _: None) for job in jobs])
        assert all_answered.wait(120), answers
    assert answers == {job.id: "done" for job in jobs}
    for job in jobs:
        if job.id != bad:
            record = rt.jobs.get(job.id)
            assert record is not None and record.status is JobStatus.succeeded and record.attempts == 1, record
    ended = json.loads(redis_client.get(keys.job(bad)))
    assert ended["status"] == "failed" and ended["error"]["type"] == "unsupported_by_worker"
    assert 'request.mode = "speculate"' in ended["error"]["message"] and "actq 0.2.0" in ended["error"]["message"]
    logged = caplog.text
    assert "KeyError" not in logged and "recording its outcome failed" not in logged, logged
    assert f"job {bad} not run: unsupported by this worker" in logged


def test_a_claim_that_raises_names_its_cause_ends_that_job_once_and_the_others_run(
    rt, redis_client, caplog, monkeypatch
):
    """A claim raising for anything but Redis (a bug, injected: no record makes one raise now):
    the batch is claimed job by job; the job whose own claim raises is logged with its cause and
    its traceback and ends failed, once; the others run."""
    jobs = [_job() for _ in range(3)]
    rt.jobs.enqueue(jobs, make_celery(rt.settings))
    bad = jobs[1].id
    real = rt.jobs.claim_many

    def claim_many(job_ids, worker, max_attempts):
        if bad in job_ids:
            raise RuntimeError("a bug in the claim")
        return real(job_ids, worker, max_attempts)

    monkeypatch.setattr(rt.jobs, "claim_many", claim_many)
    answers: dict[str, str] = {}
    all_answered = threading.Event()

    def reply(job_id: str, outcome: str) -> None:
        answers[job_id] = outcome
        if len(answers) == len(jobs):
            all_answered.set()

    with caplog.at_level(logging.INFO):
        job_flow._prepare_many(rt, [(job.id, reply, lambda *_: None, lambda _: None) for job in jobs])
        assert all_answered.wait(120), answers
    assert answers == {job.id: "done" for job in jobs}
    assert [rt.jobs.get(job.id).status for job in jobs] == [JobStatus.succeeded, JobStatus.failed, JobStatus.succeeded]
    failed = rt.jobs.get(bad)
    assert failed.error is not None and failed.error.type == "internal_error"
    assert failed.error.message == "the worker could not claim this job (RuntimeError: a bug in the claim)"
    assert "KeyError" not in caplog.text
    claimed = [r for r in caplog.records if r.getMessage() == f"job {bad}: claiming it failed"]
    assert len(claimed) == 1 and claimed[0].exc_info is not None and "a bug in the claim" in caplog.text

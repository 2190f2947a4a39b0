"""A rolling upgrade: records and model descriptions written by a newer version (fields this one
does not know) are still read by the API, which answers for, lists and waits on those jobs; an
older worker fails a job whose request it does not fully know, naming the fields, rather than run
it without what it asked for."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from shared import keys
from shared.jobs import JobStore
from shared.newer_records import VERSION
from shared.registry import ModelRegistry
from tests.support.models import tiny_llama
from tests.support.stack import TINY


def test_the_api_reads_what_a_newer_version_wrote_and_a_worker_refuses_it(http, redis_client):
    job_id = http.post("/jobs", json={"model": TINY, "prompt": "2 + 2 =", "max_tokens": 2}).json()["id"]
    stored = json.loads(redis_client.get(keys.job(job_id)))
    stored["request"]["a_later_sampling_knob"] = 0.5  # fields a newer API or worker would write
    stored["a_later_record_field"] = {"nested": True}
    redis_client.set(keys.job(job_id), json.dumps(stored), keepttl=True)
    described = json.loads(redis_client.get(keys.model(TINY)))
    redis_client.set(keys.model(TINY), json.dumps({**described, "a_later_model_field": [1, 2]}))

    one = http.get(f"/jobs/{job_id}")
    assert one.status_code == 200 and one.json()["status"] == "queued", one.text
    assert "a_later_sampling_knob" not in http.get(f"/jobs/{job_id}/request").json()
    assert job_id in [job["id"] for job in http.get("/jobs").json()]
    waited = http.get(f"/jobs/{job_id}", params={"wait": 0.1})
    assert waited.status_code == 200 and waited.json()["status"] == "queued"
    assert http.delete(f"/jobs/{job_id}").status_code in (200, 202)  # a queued job's cancel rewrites its record
    assert http.get(f"/jobs/{job_id}").json()["status"] == "cancelled"

    fresh = http.post("/jobs", json={"model": TINY, "prompt": "3 + 3 =", "max_tokens": 2}).json()["id"]
    stored = json.loads(redis_client.get(keys.job(fresh)))
    stored["request"]["a_later_sampling_knob"] = 0.5
    redis_client.set(keys.job(fresh), json.dumps(stored), keepttl=True)
    worker_store = JobStore(redis_client, retention_seconds=60)
    assert worker_store.claim(fresh, "an-older-worker", max_attempts=3) == (None, "unsupported by this worker")
    failed = http.get(f"/jobs/{fresh}").json()
    assert failed["status"] == "failed" and failed["error"]["type"] == "unsupported_by_worker"
    assert "a_later_sampling_knob" in failed["error"]["message"] and "upgrade" in failed["error"]["message"]
    known = http.post("/jobs", json={"model": TINY, "prompt": "4 + 4 =", "max_tokens": 2}).json()["id"]
    record, why = worker_store.claim(known, "an-older-worker", max_attempts=3)
    assert why == "claimed" and record is not None and record.status.value == "running"


# What a newer version might write into fields this one knows: (dotted field, stored value).
NEWER_VALUES = [
    ("request.mode", "speculate"),
    ("status", "paused"),
    ("result.finish_reason", "content_filter"),
    ("attempts", 1.5),
]


def _newer(redis_client, job_id: str, field: str, value: object, written_by: str | None = "0.2.0") -> None:
    """Rewrite a stored record as a newer version would: `value` in `field`, its version stamped."""
    stored = json.loads(redis_client.get(keys.job(job_id)))
    if field == "result.finish_reason":  # a newer worker's ending: a result only it knows how to end
        stored["status"] = "succeeded"
        stored["result"] = {"text": "4", "finish_reason": value, "usage": USAGE}
    else:
        *parents, name = field.split(".")
        place = stored
        for part in parents:
            place = place[part]
        place[name] = value
    stored.pop("written_by", None)
    if written_by is not None:
        stored["written_by"] = written_by
    redis_client.set(keys.job(job_id), json.dumps(stored), keepttl=True)


USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


@pytest.mark.parametrize(("field", "value"), NEWER_VALUES, ids=[f for f, _ in NEWER_VALUES])
def test_a_record_with_values_this_version_does_not_know_is_named_never_a_500(http, redis_client, field, value):
    """GET /jobs/{id} answers 409 `unreadable_record` naming the field, its value and the version
    that wrote it, with what it can read; GET /jobs lists the key's other jobs and names it."""
    body = {"model": TINY, "prompt": "2 + 2 =", "max_tokens": 2}
    bad, good = (http.post("/jobs", json=body).json()["id"] for _ in range(2))
    _newer(redis_client, bad, field, value)

    for answer in (http.get(f"/jobs/{bad}"), http.get(f"/jobs/{bad}", params={"wait": 0.1})):
        assert answer.status_code == 409, answer.text
        error = answer.json()
        assert error["error"] == "unreadable_record"
        assert [(u["field"], u["value"]) for u in error["unreadable"]] == [(field, json.dumps(value))]
        assert field in error["detail"] and json.dumps(value) in error["detail"] and "actq 0.2.0" in error["detail"]
        shown = error["job"]
        assert shown["id"] == bad and shown["model"] == TINY and shown["written_by"] == "0.2.0"
        assert shown["status"] == json.loads(redis_client.get(keys.job(bad)))["status"]  # as stored
    for path in (f"/jobs/{bad}/request", f"/jobs/{bad}/result"):
        assert http.get(path).status_code == 409
    assert http.delete(f"/jobs/{bad}").status_code == 409  # nothing it cannot read is changed
    assert redis_client.exists(keys.job(bad))

    listing = http.get("/jobs")
    assert listing.status_code == 200, listing.text
    assert [job["id"] for job in listing.json()] == [good]
    assert listing.headers["x-actq-unreadable-jobs"] == bad
    queued = http.get("/jobs", params={"status": "queued"})
    assert queued.status_code == 200 and good in [job["id"] for job in queued.json()]
    assert http.get(f"/jobs/{good}").json()["status"] == "queued"


def test_a_record_of_a_version_that_does_not_stamp_itself_is_named_so(http, redis_client):
    job_id = http.post("/jobs", json={"model": TINY, "prompt": "2 + 2 =", "max_tokens": 2}).json()["id"]
    assert json.loads(redis_client.get(keys.job(job_id)))["written_by"] == VERSION  # every write stamps it
    _newer(redis_client, job_id, "request.mode", "speculate", written_by=None)
    detail = http.get(f"/jobs/{job_id}").json()["detail"]
    assert "a version of actq that does not record its own" in detail and VERSION in detail


def test_another_keys_unreadable_record_is_no_job_at_all(settings, redis_client):
    """With API keys, an unreadable record is told apart from no job for its owner only."""
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    registry.publish(tiny_llama())
    registry.heartbeat(tiny_llama(), "test-worker")
    owner, other = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}
    with TestClient(create_app(settings.model_copy(update={"api_keys": "key-one,key-two"}))) as http:
        body = {"model": TINY, "prompt": "2 + 2 =", "max_tokens": 2}
        job_id = http.post("/jobs", json=body, headers=owner).json()["id"]
        _newer(redis_client, job_id, "status", "paused")
        assert http.get(f"/jobs/{job_id}", headers=owner).status_code == 409
        assert http.get(f"/jobs/{job_id}", headers=other).status_code == 404
        assert http.get("/jobs", headers=other).headers.get("x-actq-unreadable-jobs") is None
        assert http.get("/jobs", headers=owner).headers["x-actq-unreadable-jobs"] == job_id


def test_an_edit_naming_an_unreadable_jobs_rows_is_refused_naming_it_to_its_owner_only(settings, redis_client):
    from tests.api.test_interventions import KEY_A, KEY_B, WIDTH, body, edit, finished_job

    keyed = settings.model_copy(update={"api_keys": f"{KEY_A},{KEY_B}"})
    a, b = {"authorization": f"Bearer {KEY_A}"}, {"authorization": f"Bearer {KEY_B}"}
    registry = ModelRegistry(redis_client, keyed.heartbeat_ttl)
    registry.publish(tiny_llama())
    registry.heartbeat(tiny_llama(), "worker-tiny")
    with TestClient(create_app(keyed)) as app:
        source = finished_job(app, keyed, redis_client, np.ones((6, WIDTH)), headers=a)
        _newer(redis_client, source, "result.finish_reason", "content_filter")
        steer = edit(vector={"job": source, "tensor": "model.layers.1", "row": 0})
        mine = app.post("/jobs", json=body(steer), headers=a)
        assert mine.status_code == 422 and 'result.finish_reason = "content_filter"' in mine.json()["detail"], mine.text
        theirs = app.post("/jobs", json=body(steer), headers=b)
        assert theirs.status_code == 422 and "no job with id" in theirs.json()["detail"], theirs.text

"""A rolling upgrade: records and model descriptions written by a newer version (fields this one
does not know) are still read by the API, which answers for, lists and waits on those jobs; an
older worker fails a job whose request it does not fully know, naming the fields, rather than run
it without what it asked for."""

from __future__ import annotations

import json

from shared import keys
from shared.jobs import JobStore
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

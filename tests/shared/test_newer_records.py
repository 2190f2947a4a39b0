"""Records a newer version wrote, with values this one does not know, met by the job store on a
real Redis: a claim of several jobs claims the good ones and ends the unreadable one once, as
stored, with a readable `unsupported_by_worker` error; one whose very state it cannot read is left
alone; ending a job by `fail` works on an unreadable record too."""

from __future__ import annotations

import json

import pytest

from shared import keys
from shared.broker import make_celery
from shared.errors import JobTimeout, UnreadableRecord
from shared.jobs import JobStore
from shared.newer_records import read
from shared.settings import Settings
from tests.shared.test_jobs import record


@pytest.fixture
def store(redis_client, redis_server):
    store = JobStore(redis_client, retention_seconds=60)
    store.queued = [record(owner="k1") for _ in range(5)]  # type: ignore[attr-defined]
    store.enqueue(store.queued, make_celery(Settings(redis_url=redis_server.url)))  # type: ignore[attr-defined]
    return store


def _rewrite(client, job_id: str, **values: object) -> None:
    """The record as a newer version (0.2.0) writes it: `values` at dotted paths (`request__mode`)."""
    stored = json.loads(client.get(keys.job(job_id)))
    for path, value in values.items():
        *parents, name = path.split("__")
        place = stored
        for part in parents:
            place = place[part]
        place[name] = value
    stored["written_by"] = "0.2.0"
    client.set(keys.job(job_id), json.dumps(stored), keepttl=True)


def _stored(client, job_id: str) -> dict:
    return json.loads(client.get(keys.job(job_id)))


def test_a_claim_claims_the_good_jobs_and_ends_an_unreadable_one_once(store, redis_client):
    ids = [job.id for job in store.queued]
    bad, paused = ids[1], ids[3]
    _rewrite(redis_client, bad, request__mode="speculate")
    _rewrite(redis_client, paused, status="paused")  # not even its state can be read
    with pytest.raises(UnreadableRecord):
        read(redis_client.get(keys.job(bad)))

    claims = store.claim_many(ids, "engine-1", max_attempts=3)

    for job_id in (ids[0], ids[2], ids[4]):
        claimed, why = claims[job_id]
        assert why == "claimed" and claimed is not None and claimed.status.value == "running" and claimed.attempts == 1
    assert claims[bad] == (None, "unsupported by this worker")
    ended = _stored(redis_client, bad)
    assert ended["status"] == "failed" and ended["error"]["type"] == "unsupported_by_worker"
    message = ended["error"]["message"]
    assert 'request.mode = "speculate"' in message and "actq 0.2.0" in message and "upgrade" in message, message
    assert ended["request"]["mode"] == "speculate" and ended["written_by"] == "0.2.0"  # the rest as stored
    assert redis_client.zscore(keys.queued("m"), bad) is None
    assert redis_client.zscore(keys.jobs_status_index("k1", "failed"), bad) is not None
    assert redis_client.zscore(keys.jobs_status_index("k1", "queued"), bad) is None
    assert redis_client.hget(keys.counters("m"), "failed") == b"1"
    assert not redis_client.hexists(keys.quota_held("k1"), bad)  # its share of the key's quota given back
    assert int(redis_client.hget(keys.quota("k1"), "jobs")) == 4

    record_, why = claims[paused]
    assert (
        record_ is None and why.startswith("left for a worker of the version that wrote its record") and "paused" in why
    )
    assert _stored(redis_client, paused)["status"] == "paused"  # untouched
    assert redis_client.zscore(keys.queued("m"), paused) is not None

    again = store.claim_many([bad, paused], "engine-2", max_attempts=3)  # delivered again: nothing happens twice
    assert again[bad] == (None, "already failed") and _stored(redis_client, bad) == ended
    assert again[paused][0] is None and _stored(redis_client, paused)["status"] == "paused"
    assert redis_client.hget(keys.counters("m"), "failed") == b"1"


def test_failing_an_unreadable_running_job_ends_it_as_stored(store, redis_client):
    job_id = store.queued[0].id
    assert store.claim(job_id, "engine-1", max_attempts=3)[0] is not None
    _rewrite(redis_client, job_id, attempts=1.5)
    assert store.fail(job_id, JobTimeout("past its limit")) is None  # nothing it can return: it cannot read it
    ended = _stored(redis_client, job_id)
    assert ended["status"] == "failed" and ended["error"] == {"type": "timeout", "message": "past its limit"}
    assert ended["attempts"] == 1.5
    store.fail(job_id, JobTimeout("again"))
    assert _stored(redis_client, job_id)["error"]["message"] == "past its limit"  # ended once

"""The fence on a job's outcome, on a real Redis: a worker records a job's end only as the attempt
its claim made, in the transaction that ends the job. A stale attempt (the job was claimed again
while its worker was paused) changes nothing and is told it lost; the current one wins; a terminal
job stays terminal."""

from __future__ import annotations

import threading

import pytest

from shared import keys
from shared.attempts import Attempt, StaleAttempt
from shared.broker import make_celery
from shared.errors import JobCancelled, JobTimeout
from shared.jobs import JobStore
from shared.schemas import JobStatus
from shared.settings import Settings
from tests.shared.test_jobs import RESULT, new_job


@pytest.fixture
def celery(redis_server):
    return make_celery(Settings(redis_url=redis_server.url))


@pytest.fixture
def store(redis_client):
    return JobStore(redis_client, retention_seconds=60)


MANIFEST = {"uri": "file:///x", "key": "", "sha256": "0" * 64, "bytes": 1, "tensors": []}


def manifest(job_id: str, attempt: Attempt) -> dict:
    return {**MANIFEST, "key": attempt.prefix(job_id) + "/activations.safetensors"}


def claimed_twice(store: JobStore, celery) -> tuple[str, Attempt, Attempt]:
    """A job claimed by worker A, then again by worker B (the lost-message check sent it again
    while A was paused): (job id, A's attempt, B's attempt)."""
    job_id = new_job(store, celery)
    first, _ = store.claim(job_id, "host:1", 3)
    second, _ = store.claim(job_id, "host:2", 3)
    return job_id, Attempt.of(first), Attempt.of(second)


def test_a_stale_attempt_changes_nothing_and_is_told_it_lost(store, celery, redis_client):
    job_id, stale, current = claimed_twice(store, celery)
    assert (stale, current) == (Attempt(1, "host:1"), Attempt(2, "host:2"))
    before = redis_client.get(keys.job(job_id))
    counters = redis_client.hgetall(keys.counters("m"))
    big = {**RESULT, "text": "x" * 5000}  # stored apart, in the same transaction, were it recorded
    with pytest.raises(StaleAttempt, match=r"attempt 1 on host:1 lost: the record is at attempt 2 on host:2, running"):
        store.succeed(job_id, big, manifest(job_id, stale), inline_bytes=1024, attempt=stale)
    with pytest.raises(StaleAttempt) as lost:
        store.fail(job_id, JobTimeout("past its limit"), result=RESULT, attempt=stale)
    assert lost.value.attempt == stale and Attempt.of(lost.value.record) == current
    assert redis_client.get(keys.job(job_id)) == before  # byte for byte
    assert not redis_client.exists(keys.result(job_id))
    assert redis_client.hgetall(keys.counters("m")) == counters  # no stats counted, no quota given back


def test_the_current_attempt_wins_and_the_job_then_stays_terminal(store, celery, redis_client):
    job_id, stale, current = claimed_twice(store, celery)
    done = store.succeed(job_id, RESULT, manifest(job_id, current), attempt=current)
    assert done.status is JobStatus.succeeded and done.activations.key.startswith("jobs/" + job_id + "/attempt-2-")
    assert current.published(job_id, done) and not stale.published(job_id, done)
    kept = redis_client.get(keys.job(job_id))
    with pytest.raises(StaleAttempt, match="the record is at attempt 2 on host:2, succeeded"):
        store.succeed(job_id, {**RESULT, "text": "other"}, manifest(job_id, stale), attempt=stale)
    with pytest.raises(StaleAttempt, match="attempt 2 on host:2 lost: the record is at succeeded"):
        store.fail(job_id, JobCancelled("too late"), attempt=current)  # its own job, ended: terminal
    assert store.fail(job_id, JobCancelled("too late")) is None  # unfenced callers: left alone, as before
    assert redis_client.get(keys.job(job_id)) == kept
    assert redis_client.hget(keys.counters("m"), "succeeded") == b"1"


def test_the_same_outcome_written_again_by_its_attempt_is_its_own(store, celery):
    """A write whose reply an outage took is retried (JobStore waits outages out): finding its
    own outcome recorded, the attempt has won, not lost (its files must stay)."""
    job_id, _, current = claimed_twice(store, celery)
    done = store.succeed(job_id, RESULT, manifest(job_id, current), attempt=current)
    again = store.succeed(job_id, RESULT, manifest(job_id, current), attempt=current)
    assert again == done
    with pytest.raises(StaleAttempt):  # another outcome of the same attempt is not its own
        store.succeed(job_id, {**RESULT, "text": "y"}, manifest(job_id, current), attempt=current)


def test_a_failure_of_the_current_attempt_is_recorded_and_ends_the_job(store, celery):
    job_id, stale, current = claimed_twice(store, celery)
    failed = store.fail(job_id, JobCancelled("cancelled after 3 tokens"), result=RESULT, attempt=current)
    assert failed.status is JobStatus.cancelled and failed.result.text == "x"
    with pytest.raises(StaleAttempt):
        store.succeed(job_id, RESULT, manifest(job_id, stale), attempt=stale)
    assert store.get(job_id) == failed


def test_a_job_whose_record_is_gone_is_lost_too(store, celery, redis_client):
    job_id, _, current = claimed_twice(store, celery)
    store.delete(store.get(job_id))
    with pytest.raises(StaleAttempt, match="the record is gone") as lost:
        store.succeed(job_id, RESULT, manifest(job_id, current), attempt=current)
    assert lost.value.record is None and not current.published(job_id, lost.value.record)
    assert store.get(job_id) is None


def race(store: JobStore, job_id: str, attempts: tuple[Attempt, ...]) -> dict[Attempt, object]:
    """Each attempt ends the job with its own text, all released at once by a barrier: by
    attempt, what `succeed` returned or the StaleAttempt it raised."""
    barrier = threading.Barrier(len(attempts))
    outcomes: dict[Attempt, object] = {}

    def finish(attempt: Attempt) -> None:
        barrier.wait()
        try:
            text = {**RESULT, "text": str(attempt.number)}
            outcomes[attempt] = store.succeed(job_id, text, manifest(job_id, attempt), attempt=attempt)
        except StaleAttempt as exc:
            outcomes[attempt] = exc

    threads = [threading.Thread(target=finish, args=(a,)) for a in attempts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_two_attempts_finishing_at_once_record_the_current_one(store, celery):
    """Both attempts race to end the job, 20 times: each time exactly the current one is recorded,
    and the stale one is told it lost."""
    for _ in range(20):
        job_id, stale, current = claimed_twice(store, celery)
        outcomes = race(store, job_id, (stale, current))
        record = store.get(job_id)
        assert record.status is JobStatus.succeeded and record.result.text == "2"
        assert current.published(job_id, record)
        assert isinstance(outcomes[stale], StaleAttempt) and outcomes[current] == record


def test_attempt_folders_are_valid_keys_of_their_own():
    job_id = "0b6c3c4e-0d5e-4c3a-9a43-1f2b3c4d5e6f"
    assert Attempt(3, "ip-10-0-0-7.ec2.internal:4242").prefix(job_id) == (
        f"jobs/{job_id}/attempt-3-ip-10-0-0-7.ec2.internal-4242"
    )
    assert Attempt(1, None).prefix(job_id) == f"jobs/{job_id}/attempt-1"
    assert Attempt(1, "w").prefix(job_id) != Attempt(2, "w").prefix(job_id) != Attempt(2, "v").prefix(job_id)

"""The lost-message check (worker/lost_messages.py) on a real Redis: a queued job whose broker
message is gone, or stranded in `unacked` with no live worker holding it, is sent again after two
sightings; messages waiting in the queue or held by a worker's task are not duplicated; a job
that left the queue is left alone."""

from __future__ import annotations

import json
import time

import pytest

from shared import keys
from shared.broker import make_celery, task_message
from shared.jobs import JobStore
from shared.settings import Settings
from tests.shared.test_jobs import record
from worker.lost_messages import LostMessageSweeper, find_stranded

QUEUE = keys.queue("m")


@pytest.fixture
def celery(redis_server):
    return make_celery(Settings(redis_url=redis_server.url))


@pytest.fixture
def jobs(redis_client, celery):
    store = JobStore(redis_client, retention_seconds=60)
    queued = [record() for _ in range(4)]
    store.enqueue(queued, celery)
    return store, [j.id for j in queued]


def _queued_ids(client) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(QUEUE, 0, -1)]


def _sweeper(
    client, celery, confirm: float = 0.001, holding: frozenset = frozenset(), held_ttl: float = 60
) -> LostMessageSweeper:
    return LostMessageSweeper(
        client,
        "m",
        QUEUE,
        lambda j: task_message(celery, j, QUEUE),
        interval=0.001,
        confirm=confirm,
        worker_id="w1",
        holding=lambda: set(holding),
        held_ttl=held_ttl,
    )


def _strand(client, job_id: str | None = None) -> str:
    """Move the oldest message into `unacked` as kombu's QoS does on delivery; returns its job id."""
    raw = json.loads(client.rpop(QUEUE))
    tag = raw["properties"]["delivery_tag"]
    client.hset("unacked", tag, json.dumps([raw, "", QUEUE]))
    client.zadd("unacked_index", {tag: 1.0})
    return raw["headers"]["id"]


def test_a_lost_message_is_sent_again_after_two_sightings(redis_client, celery, jobs):
    _, ids = jobs
    first = redis_client.rpop(QUEUE)  # the oldest job's message, taken by a BRPOP whose reply was lost
    assert json.loads(first)["headers"]["id"] == ids[0]
    held = _strand(redis_client)  # the second one is delivered to a worker whose task holds it
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {ids[0]: None, held: held_tag(redis_client)}
    sweeper = _sweeper(redis_client, celery, holding=frozenset({held}))
    sweeper.publish_held()
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {ids[0]: None}
    assert sweeper.sweep() == []  # first sighting: only suspected
    assert redis_client.hkeys(keys.lost_suspects("m")) == [ids[0].encode()]
    redis_client.delete(keys.lost_sweep("m"))  # the next round's lock
    assert sweeper.sweep() == [ids[0]]
    assert _queued_ids(redis_client) == [ids[3], ids[2], ids[0]]  # next to be taken (BRPOP: right end)
    assert json.loads(redis_client.lrange(QUEUE, -1, -1)[0])["headers"]["task"] == keys.TASK_NAME
    assert not redis_client.exists(keys.lost_suspects("m")) and redis_client.hlen("unacked") == 1
    redis_client.delete(keys.lost_sweep("m"))
    assert sweeper.sweep() == [] and len(_queued_ids(redis_client)) == 3  # nothing sent twice


def held_tag(client) -> str:
    return next(iter(client.hkeys("unacked"))).decode()


def test_a_message_stranded_in_unacked_is_moved_back(redis_client, celery, jobs):
    """Delivered just before the consumer lost Redis, never given to a task, not restored."""
    _, ids = jobs
    stranded = _strand(redis_client)
    assert stranded == ids[0]
    sweeper = _sweeper(redis_client, celery)  # this worker's tasks hold nothing
    assert sweeper.sweep() == []
    redis_client.delete(keys.lost_sweep("m"))
    assert sweeper.sweep() == [ids[0]]
    assert _queued_ids(redis_client)[-1] == ids[0] and len(_queued_ids(redis_client)) == 4
    assert redis_client.hlen("unacked") == 0 and redis_client.zcard("unacked_index") == 0
    redis_client.delete(keys.lost_sweep("m"))
    assert sweeper.sweep() == []


def test_a_held_message_expires_with_its_worker(redis_client, celery, jobs):
    _, ids = jobs
    stranded = _strand(redis_client)
    sweeper = _sweeper(redis_client, celery, holding=frozenset({stranded}), held_ttl=0.2)
    sweeper.publish_held()
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {}
    assert 0 < redis_client.pttl(keys.held("m", "w1")) <= 200
    time.sleep(0.25)  # the worker stopped renewing it
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {ids[0]: held_tag(redis_client)}


def test_a_job_that_leaves_the_queue_is_no_longer_suspected(redis_client, celery, jobs):
    store, ids = jobs
    redis_client.rpop(QUEUE)
    sweeper = _sweeper(redis_client, celery)
    assert sweeper.sweep() == []
    store.claim(ids[0], "w", max_attempts=3)  # its message turned up after all and it runs
    redis_client.delete(keys.lost_sweep("m"))
    assert sweeper.sweep() == [] and ids[0] not in _queued_ids(redis_client)
    assert not redis_client.exists(keys.lost_suspects("m"))


def test_young_jobs_and_other_workers_rounds_are_left_alone(redis_client, celery, jobs):
    _, ids = jobs
    redis_client.rpop(QUEUE)
    assert find_stranded(redis_client, "m", QUEUE, min_age=3600) == {}  # queued too recently to judge
    redis_client.set(keys.lost_sweep("m"), "1", px=60_000)  # another worker holds this round
    assert _sweeper(redis_client, celery).sweep() == []
    assert not redis_client.exists(keys.lost_suspects("m"))


def test_a_sighting_must_be_confirmed_after_the_interval(redis_client, celery, jobs):
    redis_client.rpop(QUEUE)
    sweeper = _sweeper(redis_client, celery, confirm=3600)
    assert sweeper.sweep() == []
    redis_client.delete(keys.lost_sweep("m"))
    assert sweeper.sweep() == []  # seen twice, but not an hour apart
    assert len(_queued_ids(redis_client)) == 3

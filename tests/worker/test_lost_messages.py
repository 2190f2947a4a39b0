"""The lost-message check (worker/lost_messages.py) on a real Redis: a queued job whose broker
message is gone, or stranded in `unacked` with no live worker holding it, a running job whose
whole worker is gone (nobody holds its message), and a running job whose message is nowhere and
that no task holds, is sent again after two sightings; messages waiting in the queue or held by a
worker's task are not duplicated; a job that left the queue is left alone; a record this version cannot read, or one
that is gone, is never sent in a loop. The sweeper's
clock is the test's: a second sighting is `confirm` later by that clock, whatever the machine's
load."""

from __future__ import annotations

import json
import time
from typing import cast

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


class Clock:
    """Wall-clock time plus what the test moved it on by."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def _sweeper(
    client,
    celery,
    confirm: float = 10,
    holding: frozenset = frozenset(),
    held_ttl: float = 60,
    clock: Clock | None = None,
) -> LostMessageSweeper:
    return LostMessageSweeper(
        client,
        "m",
        QUEUE,
        lambda j: task_message(celery, j, QUEUE),
        interval=confirm,
        confirm=confirm,
        worker_id="w1",
        holding=lambda: set(holding),
        held_ttl=held_ttl,
        clock=clock or Clock(),
    )


def _next_round(client, sweeper: LostMessageSweeper, seconds: float | None = None) -> list[str]:
    """The next round: its lock free, the clock `seconds` (default: confirm) later."""
    client.delete(keys.lost_sweep("m"))
    cast(Clock, sweeper.clock).offset += sweeper.confirm if seconds is None else seconds
    return sweeper.sweep()


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
    assert _next_round(redis_client, sweeper) == []  # first sighting (the jobs are `confirm` old): suspected
    assert redis_client.hkeys(keys.lost_suspects("m")) == [ids[0].encode()]
    assert _next_round(redis_client, sweeper) == [ids[0]]
    assert _queued_ids(redis_client) == [ids[3], ids[2], ids[0]]  # next to be taken (BRPOP: right end)
    assert json.loads(redis_client.lrange(QUEUE, -1, -1)[0])["headers"]["task"] == keys.TASK_NAME
    assert not redis_client.exists(keys.lost_suspects("m")) and redis_client.hlen("unacked") == 1
    assert _next_round(redis_client, sweeper) == [] and len(_queued_ids(redis_client)) == 3  # nothing sent twice


def held_tag(client) -> str:
    return next(iter(client.hkeys("unacked"))).decode()


def test_messages_in_a_queues_later_lanes_are_not_lost(redis_client, celery):
    """A key's jobs past its fair share wait in the queue's later lanes (shared/keys.py `lanes`):
    they are waiting, not stranded, and are never sent twice."""
    store = JobStore(redis_client, retention_seconds=60, fair_share=2)
    burst = [record(owner="k") for _ in range(12)]
    store.enqueue(burst, celery)
    assert all(redis_client.llen(lane) for lane in keys.lanes("m"))  # every lane holds some
    assert find_stranded(redis_client, "m", QUEUE, min_age=0, now=time.time() + 60) == {}
    sweeper = _sweeper(redis_client, celery)
    assert _next_round(redis_client, sweeper, 60) == [] and _next_round(redis_client, sweeper, 60) == []
    assert sum(redis_client.llen(lane) for lane in keys.lanes("m")) == 12


def test_a_message_stranded_in_unacked_is_moved_back(redis_client, celery, jobs):
    """Delivered just before the consumer lost Redis, never given to a task, not restored."""
    _, ids = jobs
    stranded = _strand(redis_client)
    assert stranded == ids[0]
    sweeper = _sweeper(redis_client, celery)  # this worker's tasks hold nothing
    assert _next_round(redis_client, sweeper) == []
    assert _next_round(redis_client, sweeper) == [ids[0]]
    assert _queued_ids(redis_client)[-1] == ids[0] and len(_queued_ids(redis_client)) == 4
    assert redis_client.hlen("unacked") == 0 and redis_client.zcard("unacked_index") == 0
    assert _next_round(redis_client, sweeper) == []


def test_a_held_message_expires_with_its_worker(redis_client, celery, jobs):
    _, ids = jobs
    stranded = _strand(redis_client)
    sweeper = _sweeper(redis_client, celery, holding=frozenset({stranded}), held_ttl=0.2)
    sweeper.publish_held()
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {}
    assert 0 < redis_client.pttl(keys.held("m", "w1")) <= 200
    time.sleep(0.25)  # the worker stopped renewing it
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {ids[0]: held_tag(redis_client)}


def _running_on(store: JobStore, redis_client, job_id: str, engine: str) -> str:
    """The job's message delivered (into `unacked`, delivered long ago) and the job claimed by `engine`."""
    assert _strand(redis_client) == job_id
    redis_client.zadd("unacked_index", {held_tag(redis_client): time.time() - 3600})
    record, why = store.claim(job_id, engine, max_attempts=3)
    assert record is not None, why
    return held_tag(redis_client)


def test_a_running_job_whose_whole_worker_is_lost_is_sent_again(redis_client, celery, jobs):
    """No worker holds its message and its engine's heartbeat expired: it runs again at once,
    not after the visibility timeout; the next claim counts a second attempt."""
    store, ids = jobs
    tag = _running_on(store, redis_client, ids[0], "host:engine-1")
    assert find_stranded(redis_client, "m", QUEUE, min_age=10) == {ids[0]: tag}
    sweeper = _sweeper(redis_client, celery)
    assert _next_round(redis_client, sweeper) == []
    assert _next_round(redis_client, sweeper) == [ids[0]]
    assert _queued_ids(redis_client)[-1] == ids[0] and redis_client.hlen("unacked") == 0
    record, _ = store.claim(ids[0], "host:engine-2", max_attempts=3)
    assert record is not None and record.attempts == 2 and record.worker == "host:engine-2"
    assert _next_round(redis_client, sweeper) == []


def test_a_running_job_is_left_alone_while_a_live_worker_holds_it(redis_client, celery, jobs):
    """Its task holds it until its engine answers: never sent again meanwhile. Once no live
    worker holds it, its engine's heartbeat does not matter (a task that gave it up, its outcome
    unrecorded through a Redis outage, has an engine that lives on)."""
    store, ids = jobs
    tag = _running_on(store, redis_client, ids[0], "host:engine-1")
    held = _sweeper(redis_client, celery, holding=frozenset({ids[0]}))  # its task holds it
    held.publish_held()
    sweeper = _sweeper(redis_client, celery)
    assert [_next_round(redis_client, sweeper) for _ in range(3)] == [[], [], []]
    assert redis_client.hget("unacked", tag) is not None and ids[0] not in _queued_ids(redis_client)
    redis_client.delete(keys.held("m", "w1"))
    assert find_stranded(redis_client, "m", QUEUE, min_age=10) == {ids[0]: tag}


def test_a_just_delivered_message_is_not_judged(redis_client, celery, jobs):
    """Delivered a moment ago: its task may not have said it holds it yet."""
    store, ids = jobs
    _running_on(store, redis_client, ids[0], "host:engine-1")
    redis_client.zadd("unacked_index", {held_tag(redis_client): time.time()})
    assert find_stranded(redis_client, "m", QUEUE, min_age=60) == {}


def test_an_unacked_message_of_a_finished_job_is_dropped(redis_client, celery, jobs):
    """The worker recorded the outcome, then died before acknowledging: nothing to run again."""
    store, ids = jobs
    tag = _running_on(store, redis_client, ids[0], "host:engine-1")
    store.succeed(ids[0], _result(), None)
    assert find_stranded(redis_client, "m", QUEUE, min_age=10) == {}
    assert redis_client.hget("unacked", tag) is None and redis_client.zscore("unacked_index", tag) is None
    assert ids[0] not in _queued_ids(redis_client)


def _result() -> dict:
    return {
        "text": "",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
    }


def test_a_job_that_leaves_the_queue_is_no_longer_suspected(redis_client, celery, jobs):
    store, ids = jobs
    redis_client.rpop(QUEUE)
    sweeper = _sweeper(redis_client, celery)
    assert _next_round(redis_client, sweeper) == []
    store.claim(ids[0], "w", max_attempts=3)  # its message turned up after all and it runs (on a live engine)
    _sweeper(redis_client, celery, holding=frozenset({ids[0]})).publish_held()  # its task holds it
    assert _next_round(redis_client, sweeper) == [] and ids[0] not in _queued_ids(redis_client)
    assert not redis_client.exists(keys.lost_suspects("m"))


def test_young_jobs_and_other_workers_rounds_are_left_alone(redis_client, celery, jobs):
    _, ids = jobs
    redis_client.rpop(QUEUE)
    assert find_stranded(redis_client, "m", QUEUE, min_age=3600) == {}  # queued too recently to judge
    redis_client.set(keys.lost_sweep("m"), "1", px=60_000)  # another worker holds this round
    sweeper = _sweeper(redis_client, celery)
    cast(Clock, sweeper.clock).offset = 3600
    assert sweeper.sweep() == []
    assert not redis_client.exists(keys.lost_suspects("m"))


def test_a_sighting_must_be_confirmed_after_the_interval(redis_client, celery, jobs):
    redis_client.rpop(QUEUE)
    sweeper = _sweeper(redis_client, celery)
    assert _next_round(redis_client, sweeper) == []
    assert _next_round(redis_client, sweeper, seconds=9.9) == []  # seen twice, but not `confirm` apart
    assert len(_queued_ids(redis_client)) == 3
    assert _next_round(redis_client, sweeper, seconds=0.1) != []


def _acked(client, tag: str) -> None:
    """The message's task acknowledged it (kombu's ack: out of `unacked`), the job still running."""
    client.hdel("unacked", tag)
    client.zrem("unacked_index", tag)


def test_a_running_job_with_no_message_that_no_task_holds_is_sent_again(redis_client, celery, jobs, caplog):
    """Its message was acknowledged (or its requeue found nothing to restore) while its record
    said `running`: after an engine loss (5 jobs stayed so for 11 minutes), or after its outcome
    could not be recorded through a long Redis outage while its engine lives on. Nothing held it,
    and nothing found it. Found in the model's running index, it runs again, whether its engine
    lives or not: a task holds its job until its engine answers."""
    store, ids = jobs
    _acked(redis_client, _running_on(store, redis_client, ids[0], "host:engine-1"))
    assert ids[0] not in _queued_ids(redis_client) and redis_client.hlen("unacked") == 0
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {ids[0]: None}
    held = _sweeper(redis_client, celery, holding=frozenset({ids[0]}))
    held.publish_held()
    assert find_stranded(redis_client, "m", QUEUE, min_age=0) == {}  # a live worker's task holds it
    redis_client.delete(keys.held("m", "w1"))

    sweeper = _sweeper(redis_client, celery)
    assert _next_round(redis_client, sweeper) == []
    assert _next_round(redis_client, sweeper) == [ids[0]]
    assert _queued_ids(redis_client)[-1] == ids[0]
    assert "left running with no broker message and no task holding it" in caplog.text
    assert _next_round(redis_client, sweeper) == []  # its message waits in the queue: not sent twice
    assert _strand(redis_client) == ids[0]  # delivered again, to a worker whose engine claims it
    record, _ = store.claim(ids[0], "host:engine-2", max_attempts=3)
    assert record is not None and record.attempts == 2 and record.worker == "host:engine-2"


def _newer(client, job_id: str, **values: object) -> None:
    """The record as a newer version writes it: `values` at dotted paths (`request__mode`)."""
    stored = json.loads(client.get(keys.job(job_id)))
    for path, value in values.items():
        *parents, name = path.split("__")
        place = stored
        for part in parents:
            place = place[part]
        place[name] = value
    client.set(keys.job(job_id), json.dumps(stored), keepttl=True)


def test_a_record_this_version_cannot_read_is_never_sent_again_in_a_loop(redis_client, celery, jobs):
    """One whose state cannot be read is never sent (a worker of this version leaves it); one
    whose state can is sent once, its claim ends it, and it is never sent again."""
    store, ids = jobs
    redis_client.rpop(QUEUE)
    redis_client.rpop(QUEUE)  # the messages of ids[0] and ids[1], taken by BRPOPs whose replies were lost
    _newer(redis_client, ids[0], status="paused")
    _newer(redis_client, ids[1], request__mode="speculate")
    sweeper = _sweeper(redis_client, celery)
    assert _next_round(redis_client, sweeper) == []
    assert _next_round(redis_client, sweeper) == [ids[1]]
    redis_client.rpop(QUEUE)  # delivered to a worker of this version, which ends it
    assert store.claim(ids[1], "host:engine-1", max_attempts=3) == (None, "unsupported by this worker")
    assert [_next_round(redis_client, sweeper) for _ in range(3)] == [[], [], []]
    assert len(_queued_ids(redis_client)) == 2 and json.loads(redis_client.get(keys.job(ids[0])))["status"] == "paused"


def test_a_queued_job_whose_record_expired_leaves_the_queue_index(redis_client, celery, jobs):
    """Nothing can run it: sending it again would loop (its claim finds no job)."""
    _, ids = jobs
    redis_client.rpop(QUEUE)
    redis_client.delete(keys.job(ids[0]))
    sweeper = _sweeper(redis_client, celery)
    assert [_next_round(redis_client, sweeper) for _ in range(2)] == [[], []]
    assert redis_client.zscore(keys.queued("m"), ids[0]) is None and len(_queued_ids(redis_client)) == 3

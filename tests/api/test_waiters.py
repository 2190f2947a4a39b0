"""Long polls on one subscription per API process, on a real Redis: they answer when the job ends,
share one Redis connection however many there are, survive a lost subscription, and past the
process's capacity are refused with a 429 and Retry-After before anything is queued."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from api.errors import redis_trouble
from api.waiters import JobWaiters
from shared.broker import make_celery
from shared.errors import Busy, JobTimeout
from shared.jobs import JobStore, now
from shared.schemas import JobRecord, JobRequest, JobStatus
from shared.settings import Settings
from tests.support.stack import TINY, job_count, queued_messages


def _enqueue(store: JobStore, settings: Settings, n: int) -> list[str]:
    request = JobRequest(model=TINY, messages=[{"role": "user", "content": "hi"}])
    fields = {"status": JobStatus.queued, "model": TINY, "request": request, "max_tokens": 2}
    records = [JobRecord(id=str(uuid.uuid4()), created_at=now(), **fields) for _ in range(n)]
    store.enqueue(records, make_celery(settings))
    return [r.id for r in records]


def _connections(client: redis.Redis) -> int:
    return len(client.client_list())


def test_many_waiters_share_one_subscription_and_each_answers_when_its_job_ends(settings, redis_client):
    """300 waiters hold one subscription and no connection each; failing each job wakes its waiter."""

    baseline = _connections(redis_client)  # other tests' clients may still be connected

    async def scenario() -> tuple[int, list[JobRecord | None], JobRecord | None]:
        pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=8, timeout=5)
        store = JobStore(redis_client, 60, aclient=aioredis.Redis(connection_pool=pool))
        waiters = JobWaiters(store.aredis, store, capacity=1000)
        ids = await asyncio.to_thread(_enqueue, store, settings, 300)

        async def one(job_id: str) -> JobRecord | None:
            async with waiters.slot(None):
                return await waiters.wait(job_id, timeout=30)

        tasks = [asyncio.create_task(one(i)) for i in ids]
        while waiters.active < len(ids):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        held = await asyncio.to_thread(_connections, redis_client)
        assert not any(t.done() for t in tasks)
        for job_id in ids:
            await asyncio.to_thread(store.fail, job_id, JobTimeout("late"))
        ended = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        unknown = await waiters.wait(str(uuid.uuid4()), timeout=0.1)
        await waiters.close()
        await store.aredis.aclose()
        return held, ended, unknown

    held, ended, unknown = asyncio.run(scenario())
    # the subscription and at most the 8 pooled connections, whatever the number of waiters
    assert held - baseline <= 9, f"{held - baseline} connections for 300 waiters"
    assert all(r is not None and r.status is JobStatus.failed and r.error.type == "timeout" for r in ended)
    assert unknown is None


def test_a_lost_subscription_is_renewed_and_no_ending_is_missed(settings, redis_client):
    async def scenario() -> JobRecord | None:
        store = JobStore(redis_client, 60, aclient=aioredis.Redis.from_url(settings.redis_url))
        waiters = JobWaiters(store.aredis, store, capacity=10)
        (job_id,) = await asyncio.to_thread(_enqueue, store, settings, 1)
        waiting = asyncio.create_task(waiters.wait(job_id, timeout=20))
        await asyncio.sleep(0.3)
        killed = await asyncio.to_thread(redis_client.client_kill_filter, _type="pubsub")
        assert killed == 1
        await asyncio.sleep(0.3)
        await asyncio.to_thread(store.fail, job_id, JobTimeout("late"))
        record = await asyncio.wait_for(waiting, 3)  # well before the 5 s re-read
        await waiters.close()
        await store.aredis.aclose()
        return record

    record = asyncio.run(scenario())
    assert record is not None and record.status is JobStatus.failed


def test_waiters_take_at_most_their_share_of_the_pool_while_redis_is_slow(settings, redis_client):
    """Issue 47: a burst of 1,500 long polls got 247 answers "503 Redis cannot be reached" while
    Redis was fine: the waiters' reads took the whole pool and its wait ran out. Redis is paused
    (CLIENT PAUSE, longer than the pool's wait) while 40 waiters read: they queue for their share
    (2 of 4 connections; the subscription holds one), every one answers, and an unrelated read
    still gets the connection left."""

    async def scenario() -> tuple[list[JobRecord | None], JobRecord | None]:
        pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=4, timeout=0.5)
        store = JobStore(redis_client, 60, aclient=aioredis.Redis(connection_pool=pool))
        waiters = JobWaiters(store.aredis, store, capacity=100, reads=2)
        ids = await asyncio.to_thread(_enqueue, store, settings, 41)
        await waiters._subscription()
        await asyncio.to_thread(redis_client.client_pause, 1500)
        tasks = [asyncio.create_task(waiters.wait(job_id, timeout=0.1)) for job_id in ids[:40]]
        await asyncio.sleep(0.1)
        unrelated = await store.get_async(ids[40])
        ended = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await waiters.close()
        await store.aredis.aclose()
        return ended, unrelated

    ended, unrelated = asyncio.run(scenario())
    assert all(r is not None and r.status is JobStatus.queued for r in ended)
    assert unrelated is not None


def test_a_pool_whose_wait_ran_out_is_reported_as_a_busy_process_not_an_unreachable_redis(settings):
    async def exhausted() -> Exception:
        pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=1, timeout=0.2)
        held = await pool.get_connection()
        try:
            await aioredis.Redis(connection_pool=pool).get("x")
        except redis.ConnectionError as exc:
            return exc
        finally:
            await pool.release(held)
            await pool.aclose()
        raise AssertionError("the pool gave a second connection")

    message = redis_trouble(asyncio.run(exhausted()))
    assert "ACTQ_REDIS_MAX_CONNECTIONS" in message and "cannot be reached" not in message


def test_past_capacity_a_waiter_is_refused_with_retry_after():
    async def scenario() -> None:
        waiters = JobWaiters(None, None, capacity=2)  # type: ignore[arg-type]  # slots alone touch neither
        async with waiters.slot(None), waiters.slot(None):
            with pytest.raises(Busy, match="already holds 2 long polls") as refused:
                async with waiters.slot(None):
                    pass
            assert refused.value.retry_after > 0
        async with waiters.slot(None):  # freed again
            assert waiters.active == 1

    asyncio.run(scenario())


CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_one_key_holds_at_most_its_share_of_long_polls_and_keyless_callers_only_the_processs():
    async def scenario() -> None:
        waiters = JobWaiters(None, None, capacity=5, per_key=2)  # type: ignore[arg-type]
        async with waiters.slot("a"), waiters.slot("a"):
            with pytest.raises(Busy, match="ACTQ_MAX_LONG_POLLS_PER_KEY") as refused:
                async with waiters.slot("a"):
                    pass
            assert refused.value.retry_after > 0
            async with waiters.slot("b"), waiters.slot(None), waiters.slot(None):
                assert waiters.active == 5 and waiters.by_key == {"a": 2, "b": 1}
        assert waiters.active == 0 and waiters.by_key == {}

    asyncio.run(scenario())


def test_at_capacity_long_polls_get_429_and_the_openai_route_queues_nothing(http, redis_client):
    job_id = http.post("/jobs", json=CHAT).json()["id"]
    waiters = http.app.state.services.waiters
    waiters.active = waiters.capacity  # every place taken
    try:
        polled = http.get(f"/jobs/{job_id}", params={"wait": 5})
        before = job_count(redis_client), queued_messages(redis_client, TINY)
        chat = http.post("/v1/chat/completions", json=CHAT)
        after = job_count(redis_client), queued_messages(redis_client, TINY)
        plain = http.get(f"/jobs/{job_id}")  # a poll without `wait` needs no place
    finally:
        waiters.active = 0
    assert polled.status_code == 429 and polled.headers["retry-after"] == "2"
    assert polled.json()["error"] == "busy" and "ACTQ_MAX_LONG_POLLS" in polled.json()["detail"]
    assert chat.status_code == 429 and chat.headers["retry-after"] == "2"
    assert chat.json()["error"]["code"] == "rate_limit_exceeded"
    assert "x-should-retry" not in chat.headers  # nothing was queued: the client's retry is right
    assert after == before
    assert plain.status_code == 200


def test_an_error_while_waiting_for_a_queued_chat_job_says_do_not_retry(http, redis_client, monkeypatch):
    """The job is queued when the wait fails: the answer names it and tells OpenAI's clients not
    to resubmit (a retry would queue a second job)."""

    async def lost(*_: object, **__: object) -> None:
        raise redis.ConnectionError("Too many connections")

    monkeypatch.setattr(http.app.state.services.waiters, "wait", lost)
    before = job_count(redis_client)
    answer = http.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 503 and answer.headers["x-should-retry"] == "false"
    error = answer.json()["error"]
    assert error["code"] == "wait_failed" and error["job_id"] in error["message"]
    assert job_count(redis_client) == before + 1


def test_the_python_client_waits_on_when_every_long_poll_place_is_taken(http, monkeypatch):
    """At capacity `Job.wait` reads without `wait` and backs off instead of raising; it still
    returns once the job ends."""
    from shared.client import Client, Job

    class InProcess:  # the in-process app over HTTP (its TestClient takes no per-request timeout)
        def request(self, method: str, url: str, **kwargs: object):
            kwargs.pop("timeout", None)
            return http.request(method, url, **kwargs)

    client = Client.__new__(Client)
    client._http, client.timeout = InProcess(), 30
    job = Job(client, http.post("/jobs", json=CHAT).json())
    store = http.app.state.services.jobs
    waiters = http.app.state.services.waiters
    waiters.active = waiters.capacity
    polls = []

    def fail_on_third_poll(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 3:
            store.fail(job.id, JobTimeout("ended while the client backed off"))

    monkeypatch.setattr("shared.client.time.sleep", fail_on_third_poll)
    try:
        with pytest.raises(Exception, match="ended while the client backed off"):
            job.wait(timeout=30, poll=5)
    finally:
        waiters.active = 0
    assert len(polls) == 3 and polls[0] > 0  # it backed off between plain reads

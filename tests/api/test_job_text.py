"""api/job_text.py on a real Redis: every open feed is read on one connection, a feed opened while
the reader is blocked is read at once (not after the block), a feed opened late still gets the text
from the start, and the reader lets its connection go when no feed is open."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from api import job_text
from api.job_text import JobTexts, TextFeed
from shared import keys


async def _until(feed: TextFeed, count: int, timeout: float = 5) -> list[tuple[int, str] | None]:
    got: list[tuple[int, str] | None] = []
    async with asyncio.timeout(timeout):
        while len(got) < count:
            await feed.ready.wait()
            got += feed.take()
    return got


def test_many_feeds_share_one_connection_and_each_gets_its_own_text(settings, redis_client: redis.Redis):
    baseline = len(redis_client.client_list())

    async def scenario() -> int:
        aclient = aioredis.Redis.from_url(settings.redis_url)
        texts = JobTexts(aclient)
        feeds = [texts.open(f"job-{i}") for i in range(50)]
        await asyncio.sleep(0.3)
        held = await asyncio.to_thread(lambda: len(redis_client.client_list()))
        for i in range(50):
            await aclient.xadd(keys.job_text(f"job-{i}"), {"at": 0, "t": f"text {i} é"})
            await aclient.xadd(keys.job_text(f"job-{i}"), {"end": 1})
        for i, feed in enumerate(feeds):
            assert await _until(feed, 2) == [(0, f"text {i} é"), None]
        for feed in feeds:
            texts.close(feed)
        await aclient.aclose()
        return held

    held = asyncio.run(scenario())
    assert held - baseline <= 2, f"{held - baseline} connections for 50 feeds"


def test_a_feed_opened_while_the_reader_blocks_is_read_at_once(settings, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(job_text, "BLOCK_MS", 60_000)  # without the wake, the new key would wait a minute

    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(settings.redis_url)
        texts = JobTexts(aclient)
        first = texts.open("first")
        async with asyncio.timeout(5):
            while "first" not in texts._reading:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the XREAD is blocked in Redis by now
        second = texts.open("second")
        await aclient.xadd(keys.job_text("second"), {"at": 0, "t": "hello"})
        assert await _until(second, 1, timeout=10) == [(0, "hello")]
        texts.close(first)
        texts.close(second)
        await aclient.xadd(keys.job_text("first"), {"end": 1})  # ends the block: the reader has no feed left
        assert texts._task is not None
        await asyncio.wait_for(texts._task, 10)
        await aclient.aclose()

    asyncio.run(scenario())


def test_a_feed_opened_late_reads_from_the_first_entry(settings):
    async def scenario() -> None:
        aclient = aioredis.Redis.from_url(settings.redis_url)
        texts = JobTexts(aclient)
        early = texts.open("job")
        await aclient.xadd(keys.job_text("job"), {"at": 0, "t": "one "})
        assert await _until(early, 1) == [(0, "one ")]
        late = texts.open("job")
        await aclient.xadd(keys.job_text("job"), {"at": 4, "t": "two"})
        assert await _until(late, 2) == [(0, "one "), (4, "two")]
        assert await _until(early, 1) == [(4, "two")]  # nothing twice
        texts.close(early)
        texts.close(late)
        await aclient.aclose()

    asyncio.run(scenario())

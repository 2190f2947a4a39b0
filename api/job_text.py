"""Streamed jobs' text as workers publish it (`keys.job_text`), read on one Redis connection per
API process.

A streamed response waits for new text with XREAD BLOCK. One blocked XREAD per response would hold
one of the process's pooled connections for as long as its job runs: at ACTQ_REDIS_MAX_CONNECTIONS
streams the pool runs dry and unrelated requests wait, the failure api/waiters.py was written to
avoid for long polls. So one reader task holds one connection and blocks on every open job's
stream at once (XREAD takes many keys), handing entries to each response's `TextFeed`. A feed
opened while the reader is blocked wakes it (CLIENT UNBLOCK) so that its key is read at once; the
block is also bounded (BLOCK_MS), so a wake lost in a race costs at most that long. The reader
ends, giving its connection back, when no feed is open. If Redis fails, the reader retries while
feeds are open; a feed meanwhile only gets no text (the response ends on the job's record, whose
result has the whole text).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import cast

import redis
import redis.asyncio as aioredis

from shared import keys

log = logging.getLogger("actq.api")
BLOCK_MS = 1000  # longest single XREAD block
RETRY_SECONDS = 0.5  # wait before reading again after a Redis error
ENTRIES_PER_READ = 256  # entries per stream per XREAD


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class TextFeed:
    """One response's view of a job's text stream: `entries` arrive as (offset, text) pieces or
    None (the job left the engine: no more text comes)."""

    job_id: str
    last: str = "0-0"  # the id of the last entry handed over
    entries: list[tuple[int, str] | None] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self) -> list[tuple[int, str] | None]:
        taken, self.entries = self.entries, []
        self.ready.clear()
        return taken


class JobTexts:
    def __init__(self, aredis: aioredis.Redis) -> None:
        self.aredis = aredis
        self._feeds: dict[str, set[TextFeed]] = {}
        self._task: asyncio.Task | None = None
        self._client_id: int | None = None  # the reader's connection, while it is connected
        self._reading: dict[str, str] = {}  # job id -> the entry id the XREAD in flight reads after
        self._wakes: set[asyncio.Task] = set()

    def open(self, job_id: str) -> TextFeed:
        """A feed of `job_id`'s text from its first entry; `close` it when done."""
        feed = TextFeed(job_id)
        self._feeds.setdefault(job_id, set()).add(feed)
        loop = asyncio.get_running_loop()
        task = self._task
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._run(), name="actq-job-text")
        elif self._client_id is not None:
            wake = loop.create_task(self._wake(feed))
            self._wakes.add(wake)
            wake.add_done_callback(self._wakes.discard)
        return feed

    def close(self, feed: TextFeed) -> None:
        feeds = self._feeds.get(feed.job_id)
        if feeds is not None:
            feeds.discard(feed)
            if not feeds:
                del self._feeds[feed.job_id]

    async def _wake(self, feed: TextFeed) -> None:
        """Unblock the reader's XREAD so that its next one reads `feed`'s job from where the feed
        is (a few tries: the XREAD may not have reached Redis yet when the first arrives)."""
        for _ in range(3):
            client_id, start = self._client_id, self._reading.get(feed.job_id)
            covered = start is not None and _order(start) <= _order(feed.last)
            if covered or feed not in self._feeds.get(feed.job_id, ()) or client_id is None:
                return
            with contextlib.suppress(redis.RedisError):
                if await self.aredis.client_unblock(client_id):
                    return
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        while self._feeds:
            connection = self.aredis.client()  # one pooled connection, held while feeds are open
            try:
                self._client_id = int(await connection.client_id())
                while self._feeds:
                    await self._read(connection)
            except redis.RedisError as exc:
                log.warning("reading streamed jobs' text failed (%s); reading again", exc)
                await asyncio.sleep(RETRY_SECONDS)
            finally:
                self._client_id, self._reading = None, {}
                with contextlib.suppress(Exception):
                    await connection.aclose()

    async def _read(self, connection: aioredis.Redis) -> None:
        starts = {job_id: min((f.last for f in feeds), key=_order) for job_id, feeds in self._feeds.items()}
        self._reading = starts
        streams = {keys.job_text(job_id): last for job_id, last in starts.items()}
        reply = await connection.xread(streams, count=ENTRIES_PER_READ, block=BLOCK_MS)  # type: ignore[arg-type]
        prefix = keys.job_text("")
        for name, entries in _streams(reply):
            job_id = name.decode().removeprefix(prefix)
            start = _order(starts.get(job_id, "0-0"))
            for feed in self._feeds.get(job_id, ()):
                if _order(feed.last) < start:
                    continue  # opened during this read: entries before `start` are its too (the next read)
                for raw_id, fields in entries:
                    entry_id = raw_id.decode()
                    if _order(entry_id) <= _order(feed.last):
                        continue  # a feed opened earlier than another of the same job saw it already
                    feed.last = entry_id
                    feed.entries.append(_entry(fields))
                if feed.entries:
                    feed.ready.set()


Entries = list[tuple[bytes, dict[bytes, bytes]]]


def _streams(reply: object) -> list[tuple[bytes, Entries]]:
    """XREAD's reply as (key, entries) pairs: a list of pairs in RESP2, a map in RESP3 (whose
    values redis-py wraps in one more list)."""
    if isinstance(reply, dict):
        return [(name, value[0] if value and isinstance(value[0], list) else value) for name, value in reply.items()]
    return cast("list[tuple[bytes, Entries]]", reply or [])


def _entry(fields: dict[bytes, bytes]) -> tuple[int, str] | None:
    """An entry of a job's text stream: (offset, text), or None for its `end`."""
    if b"end" in fields:
        return None
    return int(fields.get(b"at", b"0")), fields.get(b"t", b"").decode()

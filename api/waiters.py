"""Long polls (`GET /jobs/{id}?wait=`, `POST /v1/chat/completions`) on one Redis subscription per
API process.

Workers publish every change of a job's state on `actq:job-events:<id>`. One listener per process
holds a pattern subscription to all of them and wakes the waiters of that job; a waiter costs an
asyncio.Event, not a Redis connection (a subscription each ran the pool dry at 50 waiters and
turned long polls, then unrelated requests, into 503s).

A waiter reads the record after its event is registered and the subscription confirmed, so a
change between the read and the wait is never missed. If the subscription breaks (Redis
restarts), every waiter is woken to read again, and waiters also read every RECHECK_SECONDS as a
safety net. At most `capacity` waiters per process, and at most `per_key` of one API key's
(ACTQ_MAX_LONG_POLLS, ACTQ_MAX_LONG_POLLS_PER_KEY): past either a long poll is refused at once
with a 429 and `Retry-After` (`Busy`), before anything is queued, so one key's idle long polls or
WebSocket sessions cannot take every other key's place. Callers without a key (keys off) are one
caller: only the process's bound applies to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.errors import Busy
from shared.jobs import JobStore
from shared.schemas import JobRecord

log = logging.getLogger("actq.api")
RECHECK_SECONDS = 5.0  # a waiter reads its record at least this often, events or not
RETRY_AFTER_SECONDS = 2


class JobWaiters:
    """`reads`: at most this many waiters read their records at once (a share of the process's
    Redis pool, which the long polls must not take whole: past its 5 s wait a burst's requests,
    long polls or not, answered 503 while Redis was fine). 0: no bound."""

    def __init__(self, aredis: aioredis.Redis, jobs: JobStore, capacity: int, per_key: int = 0, reads: int = 0) -> None:
        self.aredis, self.jobs, self.capacity, self.per_key = aredis, jobs, capacity, per_key
        self.reads = reads
        self._reading: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.active = 0
        self.by_key: dict[str, int] = {}  # places held per API key (keyless callers not counted)
        self._events: dict[str, set[asyncio.Event]] = {}
        self._listener: asyncio.Task | None = None
        self._subscribed: asyncio.Event | None = None
        self._prefix = keys.job_events("")

    @contextlib.asynccontextmanager
    async def slot(self, owner: str | None) -> AsyncIterator[None]:
        """One waiter's place for a caller of API key `owner` (None: keys are off); `Busy` (429)
        when all `capacity` are taken, or `per_key` of them by `owner`."""
        if self.active >= self.capacity:
            raise Busy(
                f"this API process already holds {self.capacity} long polls (ACTQ_MAX_LONG_POLLS); "
                f"retry in {RETRY_AFTER_SECONDS} s, or poll without `wait`",
                retry_after=RETRY_AFTER_SECONDS,
            )
        held = self.by_key.get(owner, 0) if owner is not None else 0
        if owner is not None and self.per_key and held >= self.per_key:
            raise Busy(
                f"your API key already holds {self.per_key} long polls or WebSocket sessions in this API process "
                f"(ACTQ_MAX_LONG_POLLS_PER_KEY); retry in {RETRY_AFTER_SECONDS} s once one ends, or poll without "
                "`wait`",
                retry_after=RETRY_AFTER_SECONDS,
            )
        self.active += 1
        if owner is not None:
            self.by_key[owner] = held + 1
        try:
            yield
        finally:
            self.active -= 1
            if owner is not None:
                left = self.by_key[owner] - 1
                if left:
                    self.by_key[owner] = left
                else:
                    del self.by_key[owner]

    async def wait(self, job_id: str, timeout: float) -> JobRecord | None:
        """The record once it is terminal, or as it is after `timeout` seconds (None: no such job).
        Call inside `slot()`."""
        event = asyncio.Event()
        self._events.setdefault(job_id, set()).add(event)
        try:
            deadline = time.monotonic() + timeout
            while True:
                event.clear()
                await self._subscription()  # again: a lost subscription is renewed before the read
                record = await self._read(job_id)
                remaining = deadline - time.monotonic()
                if record is None or record.status.terminal or remaining <= 0:
                    return record
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, RECHECK_SECONDS))
        finally:
            waiters = self._events.get(job_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._events[job_id]

    async def _read(self, job_id: str) -> JobRecord | None:
        """A waiter's read of its record, `reads` at a time (they queue here, never on the pool)."""
        if not self.reads:
            return await self.jobs.get_async(job_id)
        loop = asyncio.get_running_loop()
        if self._reading is None or self._reading[0] is not loop:
            self._reading = loop, asyncio.Semaphore(self.reads)
        async with self._reading[1]:
            return await self.jobs.get_async(job_id)

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[Watch]:
        """A `Watch` over any number of jobs for as long as the block runs (a WebSocket that
        reports several jobs' changes as they happen). Call inside `slot()`."""
        await self._subscription()
        watch = Watch(self)
        try:
            yield watch
        finally:
            for job_id in watch.ids:
                waiters = self._events.get(job_id)
                if waiters is not None:
                    waiters.discard(watch.event)
                    if not waiters:
                        del self._events[job_id]

    async def _subscription(self) -> None:
        """Start the listener if it is not running (in this event loop), and return once its
        subscription is live; a RedisError if it cannot subscribe."""
        loop = asyncio.get_running_loop()
        listener = self._listener
        if listener is None or listener.done() or listener.get_loop() is not loop:
            self._subscribed = asyncio.Event()
            listener = self._listener = loop.create_task(self._listen(self._subscribed), name="actq-job-events")
        assert self._subscribed is not None
        if self._subscribed.is_set():
            return
        ready = loop.create_task(self._subscribed.wait())
        try:
            await asyncio.wait([ready, listener], return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not self._subscribed.is_set():  # the listener ended before subscribing: say why
            listener.result()
            raise redis.ConnectionError("the job-event subscription ended before it started")

    async def _listen(self, subscribed: asyncio.Event) -> None:
        pubsub = self.aredis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.psubscribe(self._prefix + "*")
            subscribed.set()
            while True:
                message = await pubsub.get_message(timeout=RECHECK_SECONDS)
                if message is None:
                    continue
                channel = message["channel"]
                job_id = (channel.decode() if isinstance(channel, bytes) else channel).removeprefix(self._prefix)
                for event in self._events.get(job_id, ()):
                    event.set()
        except redis.RedisError as exc:
            if subscribed.is_set():
                log.warning("job-event subscription lost (%s); waiters read again", exc)
            raise
        finally:
            for waiters in list(self._events.values()):  # no event may be missed: everyone reads again
                for event in waiters:
                    event.set()
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def close(self) -> None:
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, redis.RedisError):
                await self._listener


class Watch:
    """Jobs watched together: `add` a job id, then per turn `clear()`, read the jobs, `wait()`.
    An event after `clear` and before `wait` is kept, so no change between the read and the wait
    is missed."""

    def __init__(self, waiters: JobWaiters) -> None:
        self.waiters, self.event, self.ids = waiters, asyncio.Event(), set[str]()

    def add(self, job_id: str) -> None:
        if job_id not in self.ids:
            self.ids.add(job_id)
            self.waiters._events.setdefault(job_id, set()).add(self.event)

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, timeout: float, also: asyncio.Future | None = None) -> None:
        """Until an event for a watched job, `also` is done, or `timeout` (at most RECHECK_SECONDS)."""
        await self.waiters._subscription()  # a lost subscription is renewed (its end set the event)
        woken = asyncio.ensure_future(self.event.wait())
        waiting: set[asyncio.Future] = {woken}
        if also is not None:
            waiting.add(also)
        try:
            await asyncio.wait(waiting, timeout=min(timeout, RECHECK_SECONDS), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()

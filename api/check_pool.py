"""The check pool: the threads that run a request's checks that scale with what it carries (a
large body's parse, its JSON Schemas' size, depth and metaschema, the grammars the constrained
decoder would compile: api/bodies.py, api/submit_checks.py) instead of the event loop, so that
one heavy request never holds `/health` or anyone's long poll.

Threads are shared fairly: at most ACTQ_CONTENT_CHECKS_PER_KEY submissions of one API key (all
callers together when keys are off) are checked at once, their next ones wait on the event loop
(holding no thread), and ACTQ_CONTENT_CHECK_THREADS threads serve every key together; a key that
sends a hundred heavy requests at once takes its per-key share of threads, and the other keys
are checked beside it. The checks themselves are bounded (ACTQ_MAX_SCHEMA_BYTES, checked before
anything else), so a thread is never held for long either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread
from anyio import CapacityLimiter

T = TypeVar("T")


class CheckPool:
    """Per-process: one limiter for the threads, one semaphore per key with checks in flight."""

    def __init__(self, per_key: int, threads: int) -> None:
        self.per_key, self.threads = per_key, threads
        self._limiter: CapacityLimiter | None = None  # made on the event loop, at first use
        self._keys: dict[str | None, tuple[asyncio.Semaphore, int]] = {}  # key -> (its slots, requests holding it)

    async def run(self, key: str | None, check: Callable[..., T], *args: object) -> T:
        """`check(*args)` on a thread, once `key` has a free place and a thread is free."""
        if self._limiter is None:
            self._limiter = CapacityLimiter(self.threads)
        slots, users = self._keys.get(key) or (asyncio.Semaphore(self.per_key), 0)
        self._keys[key] = (slots, users + 1)
        try:
            async with slots:
                return await anyio.to_thread.run_sync(check, *args, limiter=self._limiter)
        finally:
            slots, users = self._keys[key]
            if users == 1:
                del self._keys[key]  # no state is kept for a key with nothing in flight
            else:
                self._keys[key] = (slots, users - 1)

    def in_flight(self, key: str | None) -> int:
        """Requests of `key` being checked or waiting to be (tests and metrics)."""
        return self._keys[key][1] if key in self._keys else 0

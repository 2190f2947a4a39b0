"""The model registry: what each served model looks like, and which workers are live for it."""

from __future__ import annotations

import time
from typing import cast

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.schemas import ModelInfo


class ModelRegistry:
    """Descriptions are kept (a model stays known while no worker runs: its jobs wait queued);
    liveness comes from heartbeats scored in a sorted set per model."""

    def __init__(
        self, client: redis.Redis, heartbeat_ttl: float, cache_seconds: float = 0, aclient: aioredis.Redis | None = None
    ) -> None:
        self.redis = client
        self.aredis = aclient
        self.ttl = heartbeat_ttl
        self.cache_seconds = cache_seconds  # the API keeps found descriptions this long (one GET less per job)
        self._cache: dict[str, tuple[float, ModelInfo]] = {}

    def publish(self, info: ModelInfo) -> None:
        with self.redis.pipeline() as pipe:
            pipe.set(keys.model(info.name), info.model_dump_json())
            pipe.sadd(keys.MODELS, info.name)
            pipe.execute()

    def heartbeat(self, info: ModelInfo, worker_id: str) -> None:
        """Mark the worker live; publish the description again if Redis lost it (a restart
        without persistence, a flush), so the model never stays unknown while its worker runs."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(keys.workers(info.name), {worker_id: time.time()})
            pipe.exists(keys.model(info.name))
            _, described = pipe.execute()
        if not described:
            self.publish(info)

    def remove_worker(self, name: str, worker_id: str) -> None:
        self.redis.zrem(keys.workers(name), worker_id)

    def get(self, name: str) -> ModelInfo | None:
        return self.cached(name) or self.remember(self.redis.get(keys.model(name)))

    async def get_async(self, name: str) -> ModelInfo | None:
        """`get` on the event loop (the API's POST /jobs)."""
        assert self.aredis is not None, "ModelRegistry was built without an async client"
        return self.cached(name) or self.remember(await self.aredis.get(keys.model(name)))

    def cached(self, name: str) -> ModelInfo | None:
        """The description read within the last `cache_seconds`, if any."""
        found = self._cache.get(name)
        return found[1] if found is not None and time.monotonic() - found[0] < self.cache_seconds else None

    def remember(self, raw: bytes | str | None) -> ModelInfo | None:
        """Parse a stored description (read by the caller, e.g. with redis.asyncio) and cache it."""
        if raw is None:
            return None
        # a newer worker's description may hold fields this version does not know: read without them
        info = ModelInfo.model_validate_json(raw, extra="ignore")
        if self.cache_seconds:
            self._cache[info.name] = (time.monotonic(), info)
        return info

    def names(self) -> list[str]:
        return sorted(n.decode() if isinstance(n, bytes) else n for n in self.redis.smembers(keys.MODELS))

    async def live_counts_async(self) -> dict[str, int]:
        """Live workers per known model, in two round trips on the event loop (GET /health)."""
        assert self.aredis is not None, "ModelRegistry was built without an async client"
        names = sorted(n.decode() if isinstance(n, bytes) else n for n in await self.aredis.smembers(keys.MODELS))
        cutoff = time.time() - self.ttl
        async with self.aredis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.zremrangebyscore(keys.workers(name), "-inf", cutoff)
                pipe.zcount(keys.workers(name), cutoff, "+inf")
            replies = await pipe.execute()
        return {name: int(replies[2 * i + 1]) for i, name in enumerate(names)}

    def live_workers(self, name: str) -> list[str]:
        cutoff = time.time() - self.ttl
        self.redis.zremrangebyscore(keys.workers(name), "-inf", cutoff)
        members = cast("list[bytes | str]", self.redis.zrangebyscore(keys.workers(name), cutoff, "+inf"))  # no scores
        return [m.decode() if isinstance(m, bytes) else m for m in members]

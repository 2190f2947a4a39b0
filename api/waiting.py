"""Long polling: `GET /jobs/{id}?wait=S` answers when the job finishes, without busy polling.

Async (redis.asyncio pub/sub) so that many waiting clients hold no worker threads.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from shared import keys
from shared.schemas import JobRecord


async def wait_for_job(client: aioredis.Redis, job_id: str, timeout: float) -> JobRecord | None:
    """The record once it is terminal, or as it is after `timeout` seconds (None: unknown job).
    Subscribes before reading, so a change between the read and the wait is not missed."""
    async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
        await pubsub.subscribe(keys.job_events(job_id))
        deadline = time.monotonic() + timeout
        while True:
            raw = await client.get(keys.job(job_id))
            record = None if raw is None else JobRecord.model_validate_json(raw)
            remaining = deadline - time.monotonic()
            if record is None or record.status.terminal or remaining <= 0:
                return record
            await pubsub.get_message(timeout=min(remaining, 1.0))

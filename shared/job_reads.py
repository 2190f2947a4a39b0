"""The job store's reads: a record (parsed off the event loop when large), a result stored apart
(streamed as stored), a job's live fields, the queues' depths."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

from anyio import to_thread

from shared import keys
from shared.job_records import live_fields_of
from shared.job_transactions import JobStoreCore
from shared.schemas import JobRecord, JobStatus

PARSE_ON_LOOP_BYTES = 64 << 10  # a record larger than this is parsed on a thread, off the event loop


class JobReads(JobStoreCore):
    """The job store's reads of single jobs and queues (shared/jobs.py's JobStore; listings: there)."""

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.get(keys.job(job_id))
        return None if raw is None else self.record(raw)

    async def get_async(self, job_id: str) -> JobRecord | None:
        """`get` on the event loop; a large record (a long prompt) is parsed on a thread."""
        assert self.aredis is not None, "JobStore was built without an async client"
        raw = await self.aredis.get(keys.job(job_id))
        if raw is None:
            return None
        if len(raw) > PARSE_ON_LOOP_BYTES:
            return await to_thread.run_sync(self.record, raw)
        return self.record(raw)

    async def stored_result_async(self, job_id: str) -> bytes | None:
        """The whole JSON of a result stored apart (split_result), as stored: never parsed here."""
        assert self.aredis is not None, "JobStore was built without an async client"
        return cast("bytes | None", await self.aredis.get(keys.result(job_id)))

    async def stored_result_exists_async(self, job_id: str) -> bool:
        assert self.aredis is not None, "JobStore was built without an async client"
        return bool(await self.aredis.exists(keys.result(job_id)))

    def stored_result(self, job_id: str) -> bytes | None:
        return cast("bytes | None", self.redis.get(keys.result(job_id)))

    async def stream_stored_result(self, job_id: str, size: int, chunk: int = 64 << 10) -> AsyncIterator[bytes]:
        """A result stored apart, `size` bytes, read `chunk` bytes at a time (GETRANGE): a request
        holds one chunk, never the whole. The key is written once, with the terminal record, and
        never changed; should it vanish meanwhile (deleted, expired) the stream ends short."""
        assert self.aredis is not None, "JobStore was built without an async client"
        key = keys.result(job_id)
        for start in range(0, size, chunk):
            data = cast("bytes", await self.aredis.getrange(key, start, min(start + chunk, size) - 1))
            if not data:
                raise RuntimeError(f"the stored result of job {job_id} vanished while it was read")
            yield data

    def live_fields(self, record: JobRecord) -> dict[str, int | None]:
        """Where a queued job stands in its model's queue (1 = next); how far a running job has got."""
        rank = self.redis.zrank(keys.queued(record.model), record.id) if record.status is JobStatus.queued else None
        tokens = self.redis.get(keys.progress(record.id)) if record.status is JobStatus.running else None
        return live_fields_of(record, cast("int | None", rank), tokens)  # zrank without withscore: an int

    async def live_fields_async(self, record: JobRecord) -> dict[str, int | None]:
        assert self.aredis is not None, "JobStore was built without an async client"
        rank = tokens = None
        if record.status is JobStatus.queued:
            rank = await self.aredis.zrank(keys.queued(record.model), record.id)
        elif record.status is JobStatus.running:
            tokens = await self.aredis.get(keys.progress(record.id))
        return live_fields_of(record, cast("int | None", rank), tokens)  # zrank without withscore: an int

    def queue_depth(self, model: str) -> int:
        """How many jobs of `model` wait in its queue."""
        return int(self.redis.zcard(keys.queued(model)))

    async def queue_depths_async(self, models: list[str]) -> dict[str, int]:
        """`queue_depth` of many models in one round trip on the event loop."""
        assert self.aredis is not None, "JobStore was built without an async client"
        async with self.aredis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.zcard(keys.queued(model))
            return {model: int(n) for model, n in zip(models, await pipe.execute(), strict=True)}

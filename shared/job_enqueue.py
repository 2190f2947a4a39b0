"""New jobs into the job store: each job's record, indexes and broker message written in one
atomic Lua script, with the owner's quota checked and counted inside it (OverQuota beyond it)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

from celery import Celery

from shared import broker, keys
from shared.job_transactions import RELEASE, JobStoreCore
from shared.listing import tag_indexes
from shared.newer_records import VERSION
from shared.schemas import JobRecord

# A new job (or a batch) in one atomic step: refused whole when a job exists already or when the
# owner's queued jobs or bytes would pass their limits; otherwise every write of every job and the
# owner's quota counters. KEYS: quota hash, its held hash. ARGV: max jobs, max bytes (0: none),
# retention, n, total bytes, the fair share, the queue's later priority steps (space-separated),
# kombu's priority separator, then per job: record key, record JSON, queued set, score, id, owner's
# index, owner's status index, model counters, queue, broker message, estimated bytes, and its tag
# indexes (space-separated; each expires a retention after its newest job).
# The lane: a job goes to the queue's first list while its owner holds fewer than the fair share of
# jobs (queued or running, this one not counted), to the next below twice that, then four times,
# and to the last beyond (shared/keys.py's `lanes`); workers empty the first lane first.
_ENQUEUE = """
local n, per, first = tonumber(ARGV[4]), 12, 8
for i = 0, n - 1 do
  if redis.call('EXISTS', ARGV[first + 1 + i * per]) == 1 then return {'exists', ARGV[first + 5 + i * per]} end
end
local held = redis.call('HMGET', KEYS[1], 'jobs', 'bytes')
local jobs, bytes = tonumber(held[1] or '0'), tonumber(held[2] or '0')
if tonumber(ARGV[1]) > 0 and jobs + n > tonumber(ARGV[1]) then return {'jobs', tostring(jobs)} end
if tonumber(ARGV[2]) > 0 and bytes + tonumber(ARGV[5]) > tonumber(ARGV[2]) then return {'bytes', tostring(bytes)} end
local fair, steps = tonumber(ARGV[6]), {}
for step in string.gmatch(ARGV[7], '%S+') do steps[#steps + 1] = step end
local function lane(queue, held)
  if held < fair or #steps == 0 then return queue end
  local level, bound = 1, 2 * fair
  while held >= bound and level < #steps do level, bound = level + 1, bound * 2 end
  return queue .. ARGV[8] .. steps[level]
end
for i = 0, n - 1 do
  local a = first + i * per
  redis.call('SET', ARGV[a + 1], ARGV[a + 2], 'EX', ARGV[3])
  redis.call('ZADD', ARGV[a + 3], ARGV[a + 4], ARGV[a + 5])
  redis.call('ZADD', ARGV[a + 6], ARGV[a + 4], ARGV[a + 5])
  redis.call('ZADD', ARGV[a + 7], ARGV[a + 4], ARGV[a + 5])
  redis.call('HINCRBY', ARGV[a + 8], 'submitted', 1)
  redis.call('LPUSH', lane(ARGV[a + 9], jobs + i), ARGV[a + 10])
  redis.call('HSET', KEYS[2], ARGV[a + 5], ARGV[a + 11])
  for tag in string.gmatch(ARGV[a + 12], '%S+') do
    redis.call('ZADD', tag, ARGV[a + 4], ARGV[a + 5])
    redis.call('EXPIRE', tag, ARGV[3])
  end
end
redis.call('HINCRBY', KEYS[1], 'jobs', n)
redis.call('HINCRBY', KEYS[1], 'bytes', ARGV[5])
return {'ok'}
"""


class OverQuota(Exception):
    """Enqueueing would pass an owner's limit; nothing was written. `setting` names the limit."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.message = message
        self.setting = setting


class JobEnqueue(JobStoreCore):
    """The job store's enqueueing (shared/jobs.py's JobStore)."""

    def _enqueue_args(
        self, records: Sequence[JobRecord], celery: Celery, sizes: Sequence[int] | None, limits: tuple[int, int]
    ) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of `_ENQUEUE` (every record has the same owner)."""
        owner = records[0].owner
        assert all(r.owner == owner for r in records), "one owner per enqueue"
        sizes = list(sizes) if sizes is not None else [0] * len(records)
        argv: list[Any] = [limits[0], limits[1], self.retention, len(records), sum(sizes), self.fair_share]
        argv += [" ".join(str(step) for step in keys.PRIORITY_STEPS[1:]), keys.PRIORITY_SEP]
        for place, (record, size) in enumerate(zip(records, sizes, strict=True)):
            queue = keys.queue(record.model)
            record.written_by = VERSION  # the record as stored: its holder sees what was written
            argv += [
                keys.job(record.id),
                record.model_dump_json(),
                keys.queued(record.model),
                # a batch's jobs share created_at: a microsecond apiece keeps their order in the indexes
                repr(record.created_at.timestamp() + place * 1e-6),
                record.id,
                keys.jobs_index(owner),
                keys.jobs_status_index(owner, record.status.value),
                keys.counters(record.model),
                queue,
                broker.task_message(celery, record.id, queue, broker.shown(record)),
                int(size),
                " ".join(tag_indexes(record)),
            ]
        return [keys.quota(owner), keys.quota_held(owner)], argv

    def _enqueued(self, reply: list[Any]) -> bool:
        """True when `_ENQUEUE` wrote; False when over a limit (worth one retry after releasing
        expired jobs); raises for a job that exists already."""
        what = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if what == "ok":
            return True
        if what == "exists":
            job_id = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
            raise RuntimeError(f"job {job_id} already exists")
        return False

    def _over_quota(self, reply: list[Any], count: int, total: int, limits: tuple[int, int]) -> OverQuota:
        held = int(reply[1])
        if (reply[0].decode() if isinstance(reply[0], bytes) else reply[0]) == "jobs":
            return OverQuota(
                f"this API key has {held:,} jobs queued or running; {count:,} more would pass its limit of "
                f"{limits[0]:,} (ACTQ_MAX_QUEUED_JOBS_PER_KEY); nothing was queued: wait for some to finish",
                "ACTQ_MAX_QUEUED_JOBS_PER_KEY",
            )
        return OverQuota(
            f"this API key's queued or running jobs hold an estimated {held:,} capture bytes; {total:,} more would "
            f"pass its limit of {limits[1]:,} (ACTQ_MAX_QUEUED_BYTES_PER_KEY); nothing was queued: wait for some "
            "to finish",
            "ACTQ_MAX_QUEUED_BYTES_PER_KEY",
        )

    def enqueue(
        self,
        records: Sequence[JobRecord],
        celery: Celery,
        sizes: Sequence[int] | None = None,
        limits: tuple[int, int] = (0, 0),
    ) -> None:
        """Record and queue new jobs (one owner's) in one atomic step: all of them or none.
        `sizes`: their estimated capture bytes, held against the owner's quota until each job
        ends; `limits` (max jobs, max bytes; 0: none): beyond them OverQuota and nothing written."""
        if not records:
            return
        keys_, argv = self._enqueue_args(records, celery, sizes, limits)
        for attempt in range(2):
            reply = cast("list[Any]", self.redis.eval(_ENQUEUE, 2, *keys_, *argv))
            if self._enqueued(reply):
                return
            if attempt == 0 and not self.release_expired(records[0].owner):
                break
        raise self._over_quota(reply, len(records), int(argv[4]), limits)

    async def enqueue_async(
        self, record: JobRecord, celery: Celery, size: int = 0, limits: tuple[int, int] = (0, 0)
    ) -> None:
        """`enqueue` of one job on the event loop (the API's hot path)."""
        assert self.aredis is not None, "JobStore was built without an async client"
        keys_, argv = self._enqueue_args([record], celery, [size], limits)
        for attempt in range(2):
            reply = cast("list[Any]", await self.aredis.eval(_ENQUEUE, 2, *keys_, *argv))
            if self._enqueued(reply):
                return
            if attempt == 0 and not await asyncio.to_thread(self.release_expired, record.owner):
                break
        raise self._over_quota(reply, 1, size, limits)

    def release_expired(self, owner: str | None) -> int:
        """Give back the quota of an owner's jobs whose records are gone (expired while queued,
        never ending). Run only when a limit is reached. Returns how many were released."""
        held = [i.decode() for i in cast("list[bytes]", self.redis.hkeys(keys.quota_held(owner)))]
        released = 0
        for start in range(0, len(held), 1000):
            chunk = held[start : start + 1000]
            with self.redis.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.exists(keys.job(job_id))
                found = pipe.execute()
            for job_id, exists in zip(chunk, found, strict=True):
                if not exists and self.redis.eval(RELEASE, 2, keys.quota_held(owner), keys.quota(owner), job_id):
                    released += 1
        return released

    def quota_used(self, owner: str | None) -> tuple[int, int]:
        """(jobs, estimated capture bytes) the owner has queued or running."""
        jobs, size = cast("list[bytes | None]", self.redis.hmget(keys.quota(owner), ["jobs", "bytes"]))
        return int(jobs or 0), int(size or 0)

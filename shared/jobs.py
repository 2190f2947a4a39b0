"""The job store: every operation on a job's Redis keys, in one place.

Keys (see shared/keys.py): the JSON JobRecord, the model's queued set (queue positions), the
owner's indexes (GET /jobs; shared/listing.py says which a listing reads), the cancel flag and the
progress counter of a running job, and the Celery message on the model's queue list. State changes
are WATCH/MULTI transactions on the record, so they cannot race: a terminal record is never changed
again.

Who calls what: the API enqueues, reads, lists, cancels and deletes; the worker claims, reports
progress (reading the cancel flag), and finishes. A worker finishes as the attempt its claim
made (shared/attempts.py): the outcome of an attempt the job no longer names is refused.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
import stamina
from anyio import to_thread
from celery import Celery

from shared import broker, keys, stats
from shared.attempts import Attempt, StaleAttempt
from shared.errors import JobCancelled, JobFailure, UnreadableRecord, UnsupportedByWorker, WorkerLost
from shared.listing import AFTER, SCAN_LIMIT, JobFilters, JobPage, encode_cursor, tag_indexes
from shared.newer_records import VERSION, RecordCore, checked, ended_as_stored, newer_fields_message, read, unsupported
from shared.redis_faults import refuses_writes
from shared.schemas import RESULT_PREVIEW_CHARS, RESULT_TEXT_INLINE_CHARS, JobRecord, JobStatus, JobSummary

T = TypeVar("T")
State = JobRecord | RecordCore  # what a record's change needs of it: id, status, model, owner, created_at
# A record this version cannot read, met by a change: its new state and JSON (taken only when its
# core reads), or None to leave it.
Unreadable = Callable[[str, bytes | str, UnreadableRecord], tuple[RecordCore, str] | None]
RESULT_INLINE_BYTES = 16 << 10  # a result's JSON above this is stored apart (ACTQ_RESULT_INLINE_BYTES)
PARSE_ON_LOOP_BYTES = 64 << 10  # a record larger than this is parsed on a thread, off the event loop
PREVIEW_CHARS = 200  # of a job's prompt, in GET /jobs
LIST_CHUNK = 32  # records fetched per MGET while listing: bounds the memory one listing holds

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

# A job leaves the queued/running states (or its record expired): its share of the owner's quota
# is given back, once (HDEL says whether it still held one). KEYS: held hash, quota hash. ARGV: id.
_RELEASE = """
local b = redis.call('HGET', KEYS[1], ARGV[1])
if b then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HINCRBY', KEYS[2], 'jobs', -1)
  if b ~= '0' then redis.call('HINCRBY', KEYS[2], 'bytes', '-' .. b) end
end
return b
"""


class OverQuota(Exception):
    """Enqueueing would pass an owner's limit; nothing was written. `setting` names the limit."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.message = message
        self.setting = setting


def _outage_or_refusal(exc: Exception) -> bool:
    """What the worker's store waits out: Redis away, or Redis refusing writes (MISCONF, OOM,
    READONLY); any other error reply is a bug and surfaces at once."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) or refuses_writes(exc)


def now() -> datetime:
    return datetime.now(UTC)


def _record_stats(pipe: Any, record: JobRecord) -> None:
    """A job just ended: its figures go into the model's counters and histograms (same MULTI)."""
    counters = keys.counters(record.model)
    pipe.hincrby(counters, record.status.value, 1)
    if record.result is not None:
        pipe.hincrby(counters, "generated_tokens", record.result.usage.completion_tokens)
    if record.activations is not None:
        pipe.hincrby(counters, "captured_bytes", record.activations.bytes)
    if record.started_at is not None:
        stats.observe(pipe, record.model, "queue_wait", (record.started_at - record.created_at).total_seconds())
        if record.finished_at is not None:
            stats.observe(pipe, record.model, "duration", (record.finished_at - record.started_at).total_seconds())


def split_result(result: dict[str, Any], inline_bytes: int) -> tuple[dict[str, Any], bytes | None]:
    """A result for the record, and the whole result's JSON when it is larger than `inline_bytes`
    (None: it stays whole in the record). The record's copy of a larger one keeps the totals, the
    text unless it is longer than RESULT_TEXT_INLINE_CHARS (then its first RESULT_PREVIEW_CHARS),
    and says where the rest is (`stored`)."""
    from shared.schemas import JobResult

    whole = JobResult.model_validate(result).model_dump_json().encode()
    if len(whole) <= inline_bytes:
        return result, None
    text = result["text"]
    cut = len(text) > RESULT_TEXT_INLINE_CHARS
    summary = {**result, "text": text[:RESULT_PREVIEW_CHARS] if cut else text}
    if result.get("logprobs") is not None:
        summary["logprobs"] = {**result["logprobs"], "content": None}
    summary["stored"] = {"bytes": len(whole), "text_truncated": cut}
    return summary, whole


def summarize(record: JobRecord) -> JobSummary:
    """A job as GET /jobs lists it."""
    request = record.request
    if request.nnsight is not None:
        prompt = f"[nnsight payload {request.nnsight.sha256[:12]}] {request.nnsight.model_key}"
    elif request.prompt_token_ids is not None:
        prompt = f"[{len(request.prompt_token_ids)} token ids] " + " ".join(map(str, request.prompt_token_ids[:40]))
    else:
        prompt = request.prompt if request.prompt is not None else (request.messages or [])[-1].text
    return JobSummary(
        id=record.id,
        status=record.status,
        model=record.model,
        mode=request.mode,
        created_at=record.created_at,
        finished_at=record.finished_at,
        prompt_preview=prompt[:PREVIEW_CHARS],
        error_type=record.error.type if record.error is not None else None,
        finish_reason=record.result.finish_reason if record.result is not None else None,
        activations=record.activations is not None,
        metadata=request.metadata,
        user=request.user,
    )


def _live_fields(record: JobRecord, rank: int | None, tokens: bytes | str | None) -> dict[str, int | None]:
    if record.status is JobStatus.queued:
        return {"queue_position": None if rank is None else rank + 1}
    if record.status is JobStatus.running:
        return {"generated_tokens": int(tokens) if tokens is not None else 0}
    return {}


class JobStore:
    """Reads and changes jobs in Redis.

    `outage_seconds` > 0 (the worker's store): claim and finish wait out a Redis outage of up to
    that long, retrying with backoff, so a job's outcome is recorded once Redis is back instead of
    being lost. 0 (the API's store): errors surface at once and the API answers 503.
    `aclient` (the API's): a redis.asyncio client for the reads on the event loop.

    Rolling upgrades (shared/newer_records.py): a stored record's fields that this version does
    not know are left out when it is read, so that an older API still answers for, lists and waits
    on the jobs newer processes wrote. A job whose *request* holds such fields is not run by an
    older worker without them: `claim` fails it as `unsupported_by_worker`, naming them. A record
    holding *values* this version does not know cannot be read: reading it raises
    UnreadableRecord, a listing leaves it out and names it (`JobPage.unreadable`), and `claim`
    fails it once, as stored, when its state says it may still run, or leaves it alone when its
    state cannot be read; the other jobs claimed with it are claimed as usual. Every write stamps
    the record with this version (`written_by`), so an older reader can say which version wrote it.
    """

    def __init__(
        self,
        client: redis.Redis,
        retention_seconds: int,
        outage_seconds: float = 0,
        aclient: aioredis.Redis | None = None,
        fair_share: int = 8,
    ) -> None:
        self.redis = client
        self.aredis = aclient
        self.fair_share = fair_share  # ACTQ_FAIR_SHARE_JOBS: an owner's jobs in a model's first lane
        self.retention = retention_seconds
        self.outage_seconds = outage_seconds

    @staticmethod
    def record(raw: str | bytes) -> JobRecord:
        """A stored record, parsed; fields this version does not know are left out, values it does
        not know raise UnreadableRecord (class docstring)."""
        return read(raw)

    def _through_outage(self, call: Callable[[], T]) -> T:
        if not self.outage_seconds:
            return call()
        retrying = stamina.retry_context(
            on=_outage_or_refusal,
            attempts=None,
            timeout=self.outage_seconds,
            wait_initial=0.1,
            wait_max=2.0,
        )
        for attempt in retrying:
            with attempt:
                return call()
        raise AssertionError("unreachable: stamina retries until it returns or raises")

    # -- creating ---------------------------------------------------------------------------

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
                if not exists and self.redis.eval(_RELEASE, 2, keys.quota_held(owner), keys.quota(owner), job_id):
                    released += 1
        return released

    def quota_used(self, owner: str | None) -> tuple[int, int]:
        """(jobs, estimated capture bytes) the owner has queued or running."""
        jobs, size = cast("list[bytes | None]", self.redis.hmget(keys.quota(owner), ["jobs", "bytes"]))
        return int(jobs or 0), int(size or 0)

    # -- reading ----------------------------------------------------------------------------

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
        return _live_fields(record, cast("int | None", rank), tokens)  # zrank without withscore: an int

    async def live_fields_async(self, record: JobRecord) -> dict[str, int | None]:
        assert self.aredis is not None, "JobStore was built without an async client"
        rank = tokens = None
        if record.status is JobStatus.queued:
            rank = await self.aredis.zrank(keys.queued(record.model), record.id)
        elif record.status is JobStatus.running:
            tokens = await self.aredis.get(keys.progress(record.id))
        return _live_fields(record, cast("int | None", rank), tokens)  # zrank without withscore: an int

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

    def list(self, owner: str | None, status: JobStatus | None, limit: int) -> list[JobSummary]:
        """An owner's jobs (all jobs when keys are off) as summaries, newest first, all or in one
        state: the first page of `page`."""
        return self.page(owner, limit, JobFilters(status=status)).jobs

    def page(
        self, owner: str | None, limit: int, filters: JobFilters, cursor: tuple[str, str] | None = None
    ) -> JobPage:
        """An owner's jobs that pass `filters`, newest first, from after `cursor` (shared/listing.py
        says which index is read). At most `limit` summaries and SCAN_LIMIT records read; the
        answer's cursor is set when the index goes on. Records past their retention leave the index
        on the way. Records are fetched LIST_CHUNK at a time and only their summaries kept (results
        stored apart are never read here)."""
        indexes = filters.indexes(owner)
        if len(indexes) > 1:
            with self.redis.pipeline(transaction=False) as pipe:
                for index in indexes:
                    pipe.zcard(index)
                sizes = pipe.execute()
            indexes = [min(zip(sizes, indexes, strict=True))[1]]
        index = indexes[0]
        floor = filters.created_after.timestamp() if filters.created_after is not None else None
        found: list[JobSummary] = []
        unreadable: list[str] = []
        seen: set[str] = set()
        scanned = 0
        while scanned < SCAN_LIMIT:
            # the first read sized to the page; later ones (matches sparser than that) whole chunks
            chunk = min(LIST_CHUNK, 2 * (limit - len(found)) if scanned == 0 else LIST_CHUNK, SCAN_LIMIT - scanned)
            score, last = cursor if cursor is not None else ("", "")
            reply = cast("list[bytes]", self.redis.eval(AFTER, 1, index, score, last, chunk))
            entries = [(reply[i].decode(), reply[i + 1].decode()) for i in range(0, len(reply), 2)]
            ended = len(entries) < chunk
            if floor is not None and any(float(s) <= floor for _, s in entries):
                entries, ended = [(i, s) for i, s in entries if float(s) > floor], True
            raws = self.redis.mget([keys.job(i) for i, _ in entries]) if entries else []
            expired = [i for (i, _), raw in zip(entries, raws, strict=True) if raw is None]
            if expired:
                self.redis.zrem(index, *expired)
            for place, ((job_id, score), raw) in enumerate(zip(entries, raws, strict=True)):
                scanned += 1
                cursor = (score, job_id)
                if raw is None or job_id in seen:
                    continue
                seen.add(job_id)
                try:
                    record = self.record(raw)
                except UnreadableRecord:  # written by a newer version: named, not listed (GET /jobs/{id} says why)
                    unreadable.append(job_id)
                    continue
                if filters.matches(record):
                    found.append(summarize(record))
                    if len(found) == limit:
                        more = not ended or place < len(entries) - 1
                        return JobPage(found, encode_cursor(score, job_id) if more else None, tuple(unreadable))
            if ended:
                return JobPage(found, None, tuple(unreadable))
        return JobPage(found, None if cursor is None else encode_cursor(*cursor), tuple(unreadable))

    # -- changing ---------------------------------------------------------------------------

    def update(
        self,
        job_id: str,
        change: Callable[[JobRecord], JobRecord | None],
        stored_result: bytes | None = None,
        unreadable: Unreadable | None = None,
    ) -> JobRecord | None:
        """Apply `change` atomically. It returns the new record, or None to leave the job as it is.
        `stored_result` (a result kept apart, see split_result) is written in the same transaction,
        with the record's TTL, only when the change is. `unreadable`, if given, is called instead of
        `change` for a record this version cannot read (else UnreadableRecord is raised).

        Returns what was written, or None when nothing was (unknown job, `change` declined, or an
        unreadable record, changed or not).
        """
        key = keys.job(job_id)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        pipe.unwatch()
                        return None
                    try:
                        old = self.record(raw)
                    except UnreadableRecord as exc:
                        if unreadable is None:
                            raise
                        state = unreadable(job_id, raw, exc)
                        if state is None or exc.core is None:
                            pipe.unwatch()
                            return None
                        pipe.multi()
                        self._write_state(pipe, exc.core, *state)
                        pipe.execute()
                        return None
                    new = change(old)
                    if new is None:
                        pipe.unwatch()
                        return None
                    ttl = int(pipe.pttl(key)) if stored_result is not None else 0
                    pipe.multi()
                    self._write(pipe, old, new)
                    if stored_result is not None:
                        pipe.set(keys.result(job_id), stored_result, px=ttl if ttl > 0 else self.retention * 1000)
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue

    def update_many(
        self,
        job_ids: Sequence[str],
        change: Callable[[JobRecord], JobRecord | None],
        newer: Callable[[JobRecord, Sequence[str]], JobRecord | None] | None = None,
        unreadable: Unreadable | None = None,
    ) -> dict[str, JobRecord]:
        """`update` for several jobs in one transaction: one WATCH, one MGET, one MULTI/EXEC
        whatever their number (a change to any of them meanwhile retries them all). Returns what
        was written, by job id. `newer`, if given, is called instead of `change` for a record whose
        request has fields this version does not know (`newer_records.checked`); `unreadable`, if
        given, for a record this version cannot read (its new state and JSON, or None to leave it;
        without it, UnreadableRecord is raised). An unreadable record changed is not in the answer."""
        names = [keys.job(job_id) for job_id in job_ids]
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*names)
                    changed: list[tuple[JobRecord, JobRecord]] = []
                    as_stored: list[tuple[RecordCore, RecordCore, str]] = []
                    for job_id, raw in zip(job_ids, pipe.mget(names), strict=True):
                        if raw is None:
                            continue
                        try:
                            old, fields = checked(raw) if newer is not None else (self.record(raw), [])
                        except UnreadableRecord as exc:
                            if unreadable is None:
                                raise
                            if (state := unreadable(job_id, raw, exc)) is not None and exc.core is not None:
                                as_stored.append((exc.core, *state))
                            continue
                        if (new := newer(old, fields) if newer and fields else change(old)) is not None:
                            changed.append((old, new))
                    if not changed and not as_stored:
                        pipe.unwatch()
                        return {}
                    pipe.multi()
                    for old, new in changed:
                        self._write(pipe, old, new)
                    for core, new_core, stored in as_stored:
                        self._write_state(pipe, core, new_core, stored)
                    pipe.execute()
                    return {new.id: new for _, new in changed}
                except redis.WatchError:
                    continue

    def _write(self, pipe: redis.client.Pipeline, old: JobRecord, new: JobRecord) -> None:
        """Queue what a record's change writes (`_write_state`), the record stamped with this version
        (`new` too: its holder sees what was written)."""
        new.written_by = VERSION
        self._write_state(pipe, old, new, new.model_dump_json())

    def _write_state(self, pipe: redis.client.Pipeline, old: State, new: State, stored: str) -> None:
        """Queue what a record's change writes: the record `stored` (its TTL kept), the event, the
        status, queue and running indexes, and at the one terminal transition the stats and the
        owner's quota. `new` is the JobRecord written, or the RecordCore of one this version cannot
        read (then only the ending is counted in the stats)."""
        job_id = new.id
        pipe.set(keys.job(job_id), stored, keepttl=True)
        pipe.publish(keys.job_events(job_id), new.status.value)
        if new.status is not old.status:
            created = new.created_at.timestamp()
            pipe.zrem(keys.jobs_status_index(new.owner, old.status.value), job_id)
            pipe.zadd(keys.jobs_status_index(new.owner, new.status.value), {job_id: created})
        if new.status is not JobStatus.queued:
            pipe.zrem(keys.queued(new.model), job_id)
        if new.status is JobStatus.running:  # a claim: the lost-message check looks here
            pipe.zadd(keys.running(new.model), {job_id: time.time()})
        elif old.status is JobStatus.running:
            pipe.zrem(keys.running(new.model), job_id)
        if new.status.terminal and not old.status.terminal:
            if isinstance(new, JobRecord):
                _record_stats(pipe, new)
            else:
                pipe.hincrby(keys.counters(new.model), new.status.value, 1)
            # the owner's quota: given back once, at the one terminal transition
            pipe.eval(_RELEASE, 2, keys.quota_held(new.owner), keys.quota(new.owner), job_id)

    def claim(self, job_id: str, worker: str, max_attempts: int) -> tuple[JobRecord | None, str]:
        """Move a delivered job to running. Returns (record, why): record is None when it must not run.

        A terminal job is never re-run (a redelivered message does nothing). A job delivered
        `max_attempts` times already is failed as `worker_lost` instead of run again.
        """
        return self.claim_many([job_id], worker, max_attempts)[job_id]

    def claim_many(
        self, job_ids: Sequence[str], worker: str, max_attempts: int
    ) -> dict[str, tuple[JobRecord | None, str]]:
        """`claim` for every job of `job_ids` (distinct) in one transaction (jobs delivered
        together join the engine without a round trip each), through a Redis outage. By job id:
        (record, why). A record this version cannot read never holds the others back: it is failed
        as `unsupported_by_worker` (naming what it cannot read) when its state says it may still
        run, and left alone, for a worker of the version that wrote it, when even its state cannot
        be read."""
        if len(set(job_ids)) != len(job_ids):
            raise ValueError("claim_many: a job id appears twice (claim its deliveries one after another)")
        why = dict.fromkeys(job_ids, "unknown job")

        def newer(record: JobRecord, fields: Sequence[str]) -> JobRecord | None:
            if record.status.terminal:
                why[record.id] = f"already {record.status.value}"
                return None
            why[record.id] = "unsupported by this worker"  # running it without those fields would be wrong
            return _ended(record, UnsupportedByWorker(newer_fields_message(fields)), None)

        def unreadable(job_id: str, raw: bytes | str, exc: UnreadableRecord) -> tuple[RecordCore, str] | None:
            core = exc.core
            if core is None or core.id != job_id:
                why[job_id] = f"left for a worker of the version that wrote its record: {exc.message}"
                return None
            if core.status.terminal:
                why[job_id] = f"already {core.status.value}"
                return None
            why[job_id] = "unsupported by this worker"
            failure = UnsupportedByWorker(unsupported(exc))
            return core.model_copy(update={"status": JobStatus.failed}), ended_as_stored(raw, failure, now())

        def change(record: JobRecord) -> JobRecord | None:
            if record.status.terminal:
                why[record.id] = f"already {record.status.value}"
                return None
            if record.attempts - record.forgiven_attempts >= max_attempts:
                why[record.id] = "too many attempts"
                counted = record.attempts - record.forgiven_attempts
                lost = WorkerLost(f"the worker running this job was lost {counted} times; giving up")
                return _ended(record, lost, None)
            why[record.id] = "claimed"
            return record.model_copy(
                update={
                    "status": JobStatus.running,
                    "started_at": now(),
                    "attempts": record.attempts + 1,
                    "worker": worker,
                    "error": None,
                }
            )

        written = self._through_outage(lambda: self.update_many(job_ids, change, newer, unreadable))
        claimed = {}
        for job_id in job_ids:
            record = written.get(job_id)
            claimed[job_id] = (
                record if record is not None and record.status is JobStatus.running else None,
                why[job_id],
            )
        return claimed

    def is_nnsight(self, job_id: str) -> bool:
        """Whether `job_id` runs trusted nnsight code (a worker routes it to its nnsight engine).
        Read from the raw record without parsing the rest (a record this version cannot parse
        is the claim's to judge); False for an unknown job. Waits out a Redis outage."""
        raw = self._through_outage(lambda: self.redis.get(keys.job(job_id)))
        if raw is None:
            return False
        try:
            request = json.loads(raw).get("request")
        except ValueError:
            return False
        return isinstance(request, dict) and request.get("nnsight") is not None

    def forgive(self, job_id: str, attempt: Attempt | None = None) -> JobRecord | None:
        """A running job's delivery that ended through no fault of its own (the engine running it
        was ended by another job's trusted code, or replaced after such code): its next claim is
        not counted against ACTQ_MAX_ATTEMPTS. None when the job is not running (or, given
        `attempt`, no longer that attempt's)."""

        def change(record: JobRecord) -> JobRecord | None:
            if record.status is not JobStatus.running or record.forgiven_attempts >= record.attempts:
                return None
            if attempt is not None and not attempt.holds(record):
                return None
            return record.model_copy(update={"forgiven_attempts": record.forgiven_attempts + 1})

        return self._through_outage(lambda: self.update(job_id, change))

    def succeed(
        self,
        job_id: str,
        result: dict[str, Any],
        activations: dict[str, Any] | None,
        inline_bytes: int = RESULT_INLINE_BYTES,
        attempt: Attempt | None = None,
    ) -> JobRecord | None:
        """A running job's result (and manifest). A terminal job is left alone. A result larger
        than `inline_bytes` is stored apart from the record (split_result). `attempt` (a worker's
        call): recorded only while the record is still that attempt's and running, otherwise
        StaleAttempt and nothing changed (`_end`)."""
        shown, whole = split_result(result, inline_bytes)

        def ending(record: JobRecord) -> JobRecord:
            data = record.model_dump()
            data.update(status=JobStatus.succeeded, result=shown, activations=activations, finished_at=now())
            return JobRecord.model_validate(data)

        return self._end(job_id, ending, whole, attempt)

    def fail(
        self,
        job_id: str,
        failure: JobFailure,
        result: dict[str, Any] | None = None,
        inline_bytes: int = RESULT_INLINE_BYTES,
        attempt: Attempt | None = None,
    ) -> JobRecord | None:
        """End a job with `failure` (a JobCancelled ends it `cancelled`, anything else `failed`),
        keeping a partial `result` when given (stored apart when larger than `inline_bytes`). A
        terminal job is left alone. `attempt`: as for `succeed`. Without `attempt` (the API, the
        Celery side), a record this version cannot read is ended as stored (without the result)
        when its state can be read."""
        shown, whole = split_result(result, inline_bytes) if result is not None else (None, None)

        def as_stored(_: str, raw: bytes | str, exc: UnreadableRecord) -> tuple[RecordCore, str] | None:
            if exc.core is None or exc.core.status.terminal:
                return None
            status = JobStatus.cancelled if isinstance(failure, JobCancelled) else JobStatus.failed
            return exc.core.model_copy(update={"status": status}), ended_as_stored(raw, failure, now())

        return self._end(job_id, lambda r: _ended(r, failure, shown), whole, attempt, as_stored)

    def _end(
        self,
        job_id: str,
        ending: Callable[[JobRecord], JobRecord],
        stored_result: bytes | None,
        attempt: Attempt | None,
        unreadable: Unreadable | None = None,
    ) -> JobRecord | None:
        """Write `ending(record)` through an outage, in one transaction with the check (a
        compare-and-set): the job is running and, given `attempt`, still that attempt's. Returns
        what was written; without `attempt`, None for an unknown or terminal job (`unreadable`,
        then, ends a record this version cannot read: `update`). With `attempt`, a record it no
        longer holds (or none) raises StaleAttempt, except the very outcome this attempt wrote
        already (an outage took the reply of an EXEC that did run)."""
        seen: list[JobRecord] = []  # the record as a refused change found it

        def change(record: JobRecord) -> JobRecord | None:
            if attempt is not None and (record.status is not JobStatus.running or not attempt.holds(record)):
                seen.append(record)
                return None
            return None if record.status.terminal else ending(record)

        def write() -> JobRecord | None:
            seen.clear()
            return self.update(job_id, change, stored_result, unreadable if attempt is None else None)

        written = self._through_outage(write)
        if written is not None or attempt is None:
            return written
        current = seen[-1] if seen else None  # None: the record is gone
        if current is not None and current.status.terminal and attempt.holds(current):
            if _same_outcome(current, ending(current)):
                return current
        raise StaleAttempt(job_id, attempt, current)

    def cancel_queued(self, job_id: str, failure: JobCancelled) -> JobRecord | None:
        """A queued job becomes `cancelled` (the worker skips it); None when it is no longer queued."""
        return self.update(job_id, lambda r: _ended(r, failure, None) if r.status is JobStatus.queued else None)

    def request_cancel(self, job_id: str) -> None:
        """Ask the worker running this job to stop it (it reads the flag while generating)."""
        self.redis.set(keys.cancel(job_id), 1, ex=self.retention)

    def report_progress(self, job_id: str, generated_tokens: int) -> bool:
        """The worker's word while it generates: store the progress; True when a cancel was asked."""
        return job_id in self.report_progress_many({job_id: generated_tokens})

    def report_progress_many(self, generated_tokens: dict[str, int]) -> set[str]:
        """Store the progress of every running job of a batch and read their cancel flags, in one
        round trip; returns the ids whose cancel was asked."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id, tokens in generated_tokens.items():
                pipe.exists(keys.cancel(job_id))
                pipe.set(keys.progress(job_id), tokens, ex=self.retention)
            replies = pipe.execute()
        return {job_id for job_id, flag in zip(generated_tokens, replies[::2], strict=True) if flag}

    def delete(self, record: JobRecord) -> None:
        """Remove a finished job's record, flags, index entry and Idempotency-Key (a retry with the
        key then makes a new job at once instead of waiting for a record that is gone); its files
        are the store's to remove."""
        job_id = record.id
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.job(job_id), keys.cancel(job_id), keys.progress(job_id), keys.result(job_id))
            if record.idempotency is not None:
                pipe.delete(record.idempotency)
            pipe.zrem(keys.jobs_index(record.owner), job_id)
            pipe.zrem(keys.jobs_status_index(record.owner, record.status.value), job_id)
            for index in tag_indexes(record):
                pipe.zrem(index, job_id)
            pipe.execute()


def _same_outcome(stored: JobRecord, wanted: JobRecord) -> bool:
    """Whether `stored` is `wanted` but for the time it was written."""
    return stored.model_dump(exclude={"finished_at"}) == wanted.model_dump(exclude={"finished_at"})


def _ended(record: JobRecord, failure: JobFailure, result: dict[str, Any] | None) -> JobRecord:
    status = JobStatus.cancelled if isinstance(failure, JobCancelled) else JobStatus.failed
    data = record.model_dump()
    data.update(status=status, error=failure.as_error(), finished_at=now())
    if result is not None:
        data["result"] = result
    return JobRecord.model_validate(data)

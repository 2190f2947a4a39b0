"""The job store's core: its Redis clients, waiting out a Redis outage, and the one way a record
changes: a WATCH/MULTI transaction (`update`, `update_many`) that writes, beside the record, its
event, its state's indexes and, at its one terminal transition, its stats and the owner's quota
given back. shared/jobs.py's JobStore stands on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
import redis.asyncio as aioredis
import stamina

from shared import keys
from shared.errors import UnreadableRecord
from shared.job_records import record_stats
from shared.newer_records import VERSION, RecordCore, checked, read
from shared.redis_faults import refuses_writes
from shared.schemas import JobRecord, JobStatus

T = TypeVar("T")
State = JobRecord | RecordCore  # what a record's change needs of it: id, status, model, owner, created_at
# A record this version cannot read, met by a change: its new state and JSON (taken only when its
# core reads), or None to leave it.
Unreadable = Callable[[str, bytes | str, UnreadableRecord], tuple[RecordCore, str] | None]

# A job leaves the queued/running states (or its record expired): its share of the owner's quota
# is given back, once (HDEL says whether it still held one). KEYS: held hash, quota hash. ARGV: id.
RELEASE = """
local b = redis.call('HGET', KEYS[1], ARGV[1])
if b then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HINCRBY', KEYS[2], 'jobs', -1)
  if b ~= '0' then redis.call('HINCRBY', KEYS[2], 'bytes', '-' .. b) end
end
return b
"""


class CancelAsked(Exception):
    """A running job's cancel was asked before the outcome being written was recorded: the cancel
    wins (POST /jobs/{id}/cancel answered 202), and nothing was written."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id}: its cancel was asked before its outcome was recorded")
        self.job_id = job_id


def _outage_or_refusal(exc: Exception) -> bool:
    """What the worker's store waits out: Redis away, or Redis refusing writes (MISCONF, OOM,
    READONLY); any other error reply is a bug and surfaces at once."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) or refuses_writes(exc)


class JobStoreCore:
    """What every part of the job store stands on (shared/jobs.py's JobStore: its docstring)."""

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

    # -- changing ---------------------------------------------------------------------------

    def update(
        self,
        job_id: str,
        change: Callable[[JobRecord], JobRecord | None],
        stored_result: bytes | None = None,
        unreadable: Unreadable | None = None,
        cancel_wins: bool = False,
    ) -> JobRecord | None:
        """Apply `change` atomically. It returns the new record, or None to leave the job as it is.
        `stored_result` (a result kept apart, see split_result) is written in the same transaction,
        with the record's TTL, only when the change is. `unreadable`, if given, is called instead of
        `change` for a record this version cannot read (else UnreadableRecord is raised).
        `cancel_wins`: the job's cancel flag is read in the same transaction, and a running job
        whose cancel was asked raises CancelAsked with nothing written.

        Returns what was written, or None when nothing was (unknown job, `change` declined, or an
        unreadable record, changed or not).
        """
        key = keys.job(job_id)
        watched = [key, keys.cancel(job_id)] if cancel_wins else [key]
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*watched)
                    raw, *flag = pipe.mget(watched)
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
                    if flag and flag[0] is not None and old.status is JobStatus.running:
                        pipe.unwatch()
                        raise CancelAsked(job_id)
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
                record_stats(pipe, new)
            else:
                pipe.hincrby(keys.counters(new.model), new.status.value, 1)
            # the owner's quota: given back once, at the one terminal transition
            pipe.eval(RELEASE, 2, keys.quota_held(new.owner), keys.quota(new.owner), job_id)

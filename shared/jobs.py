"""The job store: every operation on a job's Redis keys, in one place.

Keys (see shared/keys.py): the JSON JobRecord, the model's queued set (queue positions), the
owner's indexes (GET /jobs; shared/listing.py says which a listing reads), the cancel flag and the
progress counter of a running job, and the Celery message on the model's queue list. State changes
are WATCH/MULTI transactions on the record, so they cannot race: a terminal record is never changed
again.

Who calls what: the API enqueues, reads, lists, cancels and deletes; the worker claims, reports
progress (reading the cancel flag), and finishes. A worker finishes as the attempt its claim
made (shared/attempts.py): the outcome of an attempt the job no longer names is refused.

JobStore is assembled from one module per concern: shared/job_transactions.py (the clients, the
outage retry, the one transaction every change goes through), shared/job_enqueue.py (new jobs
and the owner's quota), shared/job_reads.py (single jobs, stored results, queue depths),
shared/job_lifecycle.py (claims, endings, cancel, progress, deletion) and shared/job_records.py
(what a record's change or view computes without Redis); listing is here.
"""

from __future__ import annotations

from typing import cast

from shared import keys
from shared.errors import UnreadableRecord
from shared.job_enqueue import JobEnqueue, OverQuota
from shared.job_lifecycle import JobLifecycle
from shared.job_reads import PARSE_ON_LOOP_BYTES, JobReads
from shared.job_records import PREVIEW_CHARS, RESULT_INLINE_BYTES, now, split_result, summarize
from shared.listing import AFTER, SCAN_LIMIT, JobFilters, JobPage, encode_cursor
from shared.schemas import JobStatus, JobSummary

__all__ = [
    "LIST_CHUNK",
    "PARSE_ON_LOOP_BYTES",
    "PREVIEW_CHARS",
    "RESULT_INLINE_BYTES",
    "SCAN_LIMIT",
    "JobStore",
    "OverQuota",
    "now",
    "split_result",
    "summarize",
]

LIST_CHUNK = 32  # records fetched per MGET while listing: bounds the memory one listing holds


class JobStore(JobEnqueue, JobReads, JobLifecycle):
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

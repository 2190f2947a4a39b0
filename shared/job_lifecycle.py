"""A job's changes after it is queued, in the job store: claimed (one or many in a transaction,
through an outage), forgiven a delivery, ended (succeeded, failed, cancelled) as the attempt that
holds it, its progress reported and its cancel flag read, deleted with its keys."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from shared import keys
from shared.attempts import Attempt, StaleAttempt
from shared.errors import JobCancelled, JobFailure, UnreadableRecord, UnsupportedByWorker, WorkerLost
from shared.job_records import RESULT_INLINE_BYTES, ended, now, same_outcome, split_result
from shared.job_transactions import JobStoreCore, Unreadable
from shared.listing import tag_indexes
from shared.newer_records import RecordCore, ended_as_stored, newer_fields_message, stored_fields, unsupported
from shared.schemas import ActivationsManifest, JobRecord, JobStatus


class JobLifecycle(JobStoreCore):
    """The job store's state changes after enqueueing (shared/jobs.py's JobStore)."""

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
            return ended(record, UnsupportedByWorker(newer_fields_message(fields)), None)

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
                return ended(record, lost, None)
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
        request = stored_fields(raw).get("request")
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
        StaleAttempt and nothing changed (`_end`). A cancel asked before this transaction (the API
        answered 202) wins: CancelAsked, nothing changed, and the caller ends the job cancelled."""
        shown, whole = split_result(result, inline_bytes)
        # validated once, here (the result by split_result): the record read in the transaction is
        # valid already, and dumping and validating it whole (its request, its capture points)
        # again cost more than the write
        outcome = {
            "status": JobStatus.succeeded,
            "result": shown,
            "activations": None if activations is None else ActivationsManifest.model_validate(activations),
        }

        def ending(record: JobRecord) -> JobRecord:
            return record.model_copy(update={**outcome, "finished_at": now()})

        return self._end(job_id, ending, whole, attempt, cancel_wins=True)

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

        return self._end(job_id, lambda r: ended(r, failure, shown), whole, attempt, as_stored)

    def _end(
        self,
        job_id: str,
        ending: Callable[[JobRecord], JobRecord],
        stored_result: bytes | None,
        attempt: Attempt | None,
        unreadable: Unreadable | None = None,
        cancel_wins: bool = False,
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
            return self.update(job_id, change, stored_result, unreadable if attempt is None else None, cancel_wins)

        written = self._through_outage(write)
        if written is not None or attempt is None:
            return written
        current = seen[-1] if seen else None  # None: the record is gone
        if current is not None and current.status.terminal and attempt.holds(current):
            if same_outcome(current, ending(current)):
                return current
        raise StaleAttempt(job_id, attempt, current)

    def cancel_queued(self, job_id: str, failure: JobCancelled) -> JobRecord | None:
        """A queued job becomes `cancelled` (the worker skips it); None when it is no longer queued."""
        return self.update(job_id, lambda r: ended(r, failure, None) if r.status is JobStatus.queued else None)

    def request_cancel(self, job_id: str) -> bool:
        """Ask the worker running this job to stop it (it reads the flag while generating, and
        `succeed` reads it in the transaction that would end the job). The flag is set in one
        transaction with the check that the job is still running, so a job whose outcome was
        recorded first is never told it will be cancelled: False then (and for an unknown job)."""
        key, flag = keys.job(job_id), keys.cancel(job_id)
        with self.redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None or stored_fields(raw).get("status") != JobStatus.running.value:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.set(flag, 1, ex=self.retention)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

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

    def cancels_asked(self, job_ids: list[str]) -> set[str]:
        """The ids among `job_ids` whose cancel was asked: one command while none was (every
        round but the rare one), then one pipelined round trip to tell which."""
        if not job_ids or not self.redis.exists(*(keys.cancel(job_id) for job_id in job_ids)):
            return set()
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(keys.cancel(job_id))
            flags = pipe.execute()
        return {job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag}

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

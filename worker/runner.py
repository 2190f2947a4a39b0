"""Running delivered jobs: claim -> the engine thread's batch -> artifacts -> outcome, with every
failure mapped to the job's recorded error. `submit` hands a job to the scheduler; the job's
claim and tokenization happen when it joins a batch, and its artifacts are written and its outcome
recorded on a finisher thread, so the engine thread goes on decoding the rest of the batch."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import redis
from celery.utils.log import get_task_logger

from shared.errors import InternalError, JobCancelled, JobFailure, JobTimeout, OutOfMemory
from shared.schemas import JobRecord, JobResult, Usage
from worker import runtime
from worker.scheduler import Entry

if TYPE_CHECKING:
    from worker.decoding import Sequence, Watch
    from worker.engine import Generation

log = get_task_logger(__name__)
WATCH_INTERVAL = 0.05  # seconds between cancel-flag reads (and progress writes) while generating
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_finisher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="actq-finish")


class NotRun(Exception):
    """The delivered job must not run (already terminal, or out of attempts)."""


def release_memory() -> None:
    """Give the heap memory a job freed back to the system (glibc keeps freed blocks otherwise, and
    a worker's resident size would ratchet up to its largest job). Tens of microseconds."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only (not musl)
    if trim is not None:
        trim(0)


# What `submit`'s callback hears once the job is over: "done" (its outcome is recorded, or it was
# not to run) or "redis" (Redis stayed away past ACTQ_REDIS_OUTAGE_SECONDS: nothing recorded).
Reply = Callable[[str, str], None]


def submit(job_id: str, reply: Reply, started: Callable[[str], None] = lambda _: None) -> None:
    """Queue `job_id` for the engine thread. `started(job_id)` is called when it joins a batch and
    `reply(job_id, outcome)` once it is over; neither blocks."""
    rt = runtime.get()
    holder: dict[str, object] = {}

    def prepare() -> Sequence:
        record, why = rt.jobs.claim(job_id, rt.worker_id, rt.settings.max_attempts)
        if record is None:
            raise NotRun(why)
        holder["record"], holder["started"] = record, time.perf_counter()
        log.info("job %s running (attempt %d)", job_id, record.attempts)
        started(job_id)
        return rt.engine.prepare(record.request, record.capture_points, record.max_tokens, _watch(rt, record))

    def done(outcome: Sequence | Exception) -> None:
        _finisher.submit(_finish, rt, job_id, holder, outcome, reply)

    rt.scheduler.submit(Entry(prepare=prepare, done=done, estimate=rt.engine.estimate))


def _finish(rt: runtime.Runtime, job_id: str, holder: dict, outcome: Sequence | Exception, reply: Reply) -> None:
    answer = "done"
    try:
        if isinstance(outcome, NotRun):
            log.info("job %s not run: %s", job_id, outcome)
        elif isinstance(outcome, redis.RedisError):
            log.error("job %s: it could not be claimed; Redis is unreachable", job_id)
            answer = "redis"
        else:
            _record(rt, holder["record"], holder["started"], outcome)
    except redis.RedisError:  # Redis stayed away past ACTQ_REDIS_OUTAGE_SECONDS: the broker redelivers the job
        log.error("job %s: its outcome could not be recorded; Redis is unreachable", job_id)
        answer = "redis"
    except Exception:
        log.exception("job %s: recording its outcome failed", job_id)
    finally:
        release_memory()
        reply(job_id, answer)


def _record(rt: runtime.Runtime, record: JobRecord, started: float, outcome: Sequence | Exception) -> None:
    job_id = record.id
    try:
        if isinstance(outcome, Exception):
            raise outcome
        generation = rt.engine.finish(outcome, record.request)
        if generation.stopped_by is not None:
            _stopped(rt, record, generation)
            return
        generated = time.perf_counter()
        manifest = None
        if record.capture_points:
            from worker.artifacts import write_activations

            assert record.request.capture is not None  # capture points come from a capture spec
            positions = record.request.capture.positions
            manifest = write_activations(rt.store, record.id, record.model, positions, generation)
        rt.jobs.succeed(
            record.id, _result(generation).model_dump(), manifest.model_dump() if manifest is not None else None
        )
        log.info(
            "job %s succeeded: %d tokens, generate %.1f ms, store %.1f ms",
            record.id,
            generation.completion_tokens,
            (generated - started) * 1e3,
            (time.perf_counter() - generated) * 1e3,
        )
    except JobFailure as exc:
        _fail(rt, job_id, exc)
    except redis.RedisError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure ends the job, never the worker
        _fail(rt, job_id, _classify(exc))


def _result(generation: Generation, finish_reason: str | None = None) -> JobResult:
    usage = Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=generation.completion_tokens,
        total_tokens=generation.prompt_tokens + generation.completion_tokens,
    )
    return JobResult(text=generation.text, finish_reason=finish_reason or generation.finish_reason, usage=usage)


def time_limit(settings_limit: float, record: JobRecord) -> float:
    """The request's time_limit, never more than the deployment's ACTQ_JOB_SOFT_TIME_LIMIT."""
    return min(settings_limit, record.request.time_limit or float("inf"))


def _watch(rt: runtime.Runtime, record: JobRecord) -> Watch:
    """Asked after every decoding step: stop for a cancel flag or the job's deadline. Redis is read
    at most every WATCH_INTERVAL seconds (and the progress written then), not at every token."""
    deadline = time.monotonic() + time_limit(rt.settings.job_soft_time_limit, record)
    last = [0.0]

    def watch(generated_tokens: int) -> str | None:
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        if now - last[0] < WATCH_INTERVAL:
            return None
        last[0] = now
        try:
            cancelled = rt.jobs.report_progress(record.id, generated_tokens)
        except redis.RedisError:  # progress is best effort; the job goes on
            return None
        return "cancelled" if cancelled else None

    return watch


def _stopped(rt: runtime.Runtime, record: JobRecord, generation: Generation) -> None:
    """A generation the watch ended: cancelled (with what it had written) or out of time."""
    tokens = generation.completion_tokens
    failure: JobFailure
    if generation.stopped_by == "cancelled":
        failure = JobCancelled(f"cancelled by DELETE /jobs/{{id}} while running, after {tokens} tokens")
    else:
        limit = time_limit(rt.settings.job_soft_time_limit, record)
        failure = JobTimeout(f"the job ran past its time limit of {limit:g}s (after {tokens} tokens)")
    rt.jobs.fail(record.id, failure, result=_result(generation, failure.error_type).model_dump())
    log.info("job %s ended %s after %d tokens", record.id, failure.error_type, tokens)


def _classify(exc: Exception) -> JobFailure:
    from worker.decoding import OUT_OF_MEMORY, is_oom

    if is_oom(exc):
        return OutOfMemory(OUT_OF_MEMORY)
    log.error("job failed unexpectedly", exc_info=exc)
    return InternalError(f"{type(exc).__name__}: {str(exc)[:500]}")


def _fail(rt: runtime.Runtime, job_id: str, exc: JobFailure) -> None:
    log.warning("job %s failed: %s: %s", job_id, exc.error_type, exc.message)
    rt.jobs.fail(job_id, exc)

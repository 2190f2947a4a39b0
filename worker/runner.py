"""Running one delivered job: claim -> capture engine -> artifacts -> outcome, and every failure
mapped to the job's recorded error. The Celery task in celery_app.py is one call to `run`."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import TYPE_CHECKING

import redis
from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.log import get_task_logger

from shared.errors import InternalError, JobCancelled, JobFailure, JobTimeout, OutOfMemory
from shared.schemas import JobRecord, JobResult, Usage
from worker import runtime

if TYPE_CHECKING:
    from worker.engine import Generation, Watch

log = get_task_logger(__name__)  # celery's task logger: lines carry the task's id and name
WATCH_INTERVAL = 0.05  # seconds between cancel-flag reads (and progress writes) while generating
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def release_memory() -> None:
    """Give the heap memory a job freed back to the system (glibc keeps freed blocks otherwise, and
    a worker's resident size would ratchet up to its largest job). Tens of microseconds."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only (not musl)
    if trim is not None:
        trim(0)


def run(job_id: str) -> None:
    """Run the job `job_id` if it may run (not terminal, attempts left); record its outcome.
    A failure ends the job, never the worker; only a Redis outage longer than the worker waits
    out is raised (the broker then redelivers the job)."""
    rt = runtime.get()
    record, why = rt.jobs.claim(job_id, rt.worker_id, rt.settings.max_attempts)
    if record is None:
        log.info("job %s not run: %s", job_id, why)
        return
    log.info("job %s running (attempt %d)", job_id, record.attempts)
    try:
        _run_and_record(rt, record)
    finally:
        release_memory()


def _run_and_record(rt: runtime.Runtime, record: JobRecord) -> None:
    job_id = record.id
    try:
        _run(rt, record)
    except SoftTimeLimitExceeded:
        _fail(rt, job_id, JobTimeout(f"the job ran past the time limit of {rt.settings.job_soft_time_limit:g}s"))
    except JobFailure as exc:
        _fail(rt, job_id, exc)
    except redis.RedisError:  # Redis stayed away past ACTQ_REDIS_OUTAGE_SECONDS: the broker redelivers the job
        log.error("job %s: its outcome could not be recorded; Redis is unreachable", job_id)
        raise
    except Exception as exc:  # noqa: BLE001 - any failure ends the job, never the worker
        _fail(rt, job_id, _classify(exc))


def _run(rt: runtime.Runtime, record: JobRecord) -> None:
    started = time.perf_counter()
    generation = rt.engine.run(record.request, record.capture_points, record.max_tokens, watch=_watch(rt, record))
    generated = time.perf_counter()
    if generation.stopped_by is not None:
        _stopped(rt, record, generation)
        return
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
    import torch

    text = str(exc).lower()
    if (
        isinstance(exc, (torch.OutOfMemoryError, MemoryError))
        or "out of memory" in text
        or "can't allocate memory" in text
    ):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return OutOfMemory("the model ran out of memory on this job; ask for fewer tokens or capture less")
    log.exception("job failed unexpectedly")
    return InternalError(f"{type(exc).__name__}: {str(exc)[:500]}")


def _fail(rt: runtime.Runtime, job_id: str, exc: JobFailure) -> None:
    log.warning("job %s failed: %s: %s", job_id, exc.error_type, exc.message)
    rt.jobs.fail(job_id, exc)

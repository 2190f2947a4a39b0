"""The thin task: claim the job -> run the capture engine -> store activations -> record the outcome."""

from __future__ import annotations

import time

import redis
from celery.exceptions import SoftTimeLimitExceeded
from celery.utils.log import get_task_logger

from shared import keys
from shared.errors import InternalError, JobFailure, JobTimeout, OutOfMemory
from shared.schemas import JobResult, JobStatus, Usage
from worker import runtime

log = get_task_logger(__name__)
WATCH_INTERVAL = 0.05  # seconds between cancel-flag reads (and progress writes) while generating


def run_job(job_id: str) -> None:
    rt = runtime.get()
    record, why = rt.jobs.claim(job_id, rt.worker_id, rt.settings.max_attempts)
    if record is None:
        log.info("job %s not run: %s", job_id, why)
        return
    request = record.request
    max_tokens = record.max_tokens
    log.info("job %s running (attempt %d)", job_id, record.attempts)
    try:
        started = time.perf_counter()
        generation = rt.engine.run(request, record.capture_points, max_tokens, watch=_watch(rt, record))
        generated = time.perf_counter()
        if generation.stopped_by is not None:
            _stopped(rt, record, generation)
            return
        manifest = None
        if record.capture_points:
            from worker.artifacts import write_activations

            manifest = write_activations(rt.store, job_id, record.model, request.capture.positions, generation)
        result = _result(generation)
        rt.jobs.finish(job_id, status=JobStatus.succeeded, result=result.model_dump(), activations=manifest and manifest.model_dump())
        log.info(
            "job %s succeeded: %d tokens, generate %.1f ms, store %.1f ms",
            job_id, generation.completion_tokens, (generated - started) * 1e3, (time.perf_counter() - generated) * 1e3,
        )  # fmt: skip
    except SoftTimeLimitExceeded:
        _fail(rt, job_id, JobTimeout(f"the job ran past the time limit of {rt.settings.job_soft_time_limit:g}s"))
    except JobFailure as exc:
        _fail(rt, job_id, exc)
    except redis.RedisError:  # Redis stayed away past ACTQ_REDIS_OUTAGE_SECONDS: the broker redelivers the job
        log.error("job %s: its outcome could not be recorded; Redis is unreachable", job_id)
        raise
    except Exception as exc:  # noqa: BLE001 - any failure ends the job, never the worker
        _fail(rt, job_id, _classify(exc))


def _result(generation, finish_reason: str | None = None) -> JobResult:
    usage = Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=generation.completion_tokens,
        total_tokens=generation.prompt_tokens + generation.completion_tokens,
    )
    return JobResult(text=generation.text, finish_reason=finish_reason or generation.finish_reason, usage=usage)


def _time_limit(rt: runtime.Runtime, record) -> float:
    """The request's time_limit, never more than the deployment's ACTQ_JOB_SOFT_TIME_LIMIT."""
    return min(rt.settings.job_soft_time_limit, record.request.time_limit or float("inf"))


def _watch(rt: runtime.Runtime, record):
    """Asked after every decoding step: stop for a cancel flag or the job's deadline. Redis is read
    at most every WATCH_INTERVAL seconds (and the progress written then), not at every token."""
    deadline = time.monotonic() + _time_limit(rt, record)
    last = [0.0]

    def watch(generated_tokens: int) -> str | None:
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        if now - last[0] < WATCH_INTERVAL:
            return None
        last[0] = now
        try:
            with rt.jobs.redis.pipeline(transaction=False) as pipe:
                pipe.exists(keys.cancel(record.id))
                pipe.set(keys.progress(record.id), generated_tokens, ex=rt.settings.job_retention_seconds)
                cancelled, _ = pipe.execute()
        except redis.RedisError:  # progress is best effort; the job goes on
            return None
        return "cancelled" if cancelled else None

    return watch


def _stopped(rt: runtime.Runtime, record, generation) -> None:
    """A generation the watch ended: cancelled (with what it had written) or out of time."""
    tokens = generation.completion_tokens
    if generation.stopped_by == "cancelled":
        message = f"cancelled by DELETE /jobs/{{id}} while running, after {tokens} tokens"
        rt.jobs.finish(record.id, status=JobStatus.cancelled, result=_result(generation, "cancelled").model_dump(),
                       error={"type": "cancelled", "message": message})  # fmt: skip
        log.info("job %s cancelled after %d tokens", record.id, tokens)
        return
    message = f"the job ran past its time limit of {_time_limit(rt, record):g}s (after {tokens} tokens)"
    rt.jobs.finish(record.id, status=JobStatus.failed, result=_result(generation, "timeout").model_dump(),
                   error={"type": "timeout", "message": message})  # fmt: skip
    log.warning("job %s failed: timeout after %d tokens", record.id, tokens)


def _classify(exc: Exception) -> JobFailure:
    import torch

    text = str(exc).lower()
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text or "can't allocate memory" in text:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return OutOfMemory("the model ran out of memory on this job; ask for fewer tokens or capture less")
    log.exception("job failed unexpectedly")
    return InternalError(f"{type(exc).__name__}: {str(exc)[:500]}")


def _fail(rt: runtime.Runtime, job_id: str, exc: JobFailure) -> None:
    log.warning("job %s failed: %s: %s", job_id, exc.error_type, exc.message)
    rt.jobs.finish(job_id, status=JobStatus.failed, error={"type": exc.error_type, "message": exc.message})

"""Running delivered jobs: claim -> the engine thread's batch -> artifacts -> outcome, with every
failure mapped to the job's recorded error. Artifacts go in the claim's own folder and the
outcome is recorded only while the job is still that claim's (shared/attempts.py); an attempt
that lost logs its outcome and removes its folder. `submit` hands a job to a preparing thread, which
claims it (Redis, waiting out an outage) and tokenizes it, then queues it for the engine thread;
its outcome is recorded on a finisher thread, or, when it writes files (activations, log-probabilities
past the inline limit, nnsight saves, earlier attempts' folders to tidy), on the store's own pool
(worker/results/store_writes.py): a slow or unreachable store never delays a job that stores nothing, and
holds back only capture jobs. The engine thread itself never waits on Redis, a tokenizer or the
store: it decodes the batch."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from celery.utils.log import get_task_logger

from shared.attempts import Attempt, StaleAttempt
from shared.edit_refs import References
from shared.errors import InternalError, JobCancelled, JobFailure, JobTimeout
from shared.job_transactions import CancelAsked
from shared.schemas import BaselineResult, JobRecord, JobRequest
from worker.engine import finishing, runtime
from worker.engine.scheduler import Entry
from worker.engine.text_stream import TextStream
from worker.model.memory import release_memory_soon
from worker.results import attempt_files
from worker.results.job_result import job_result
from worker.rules.failures import failure_of

if TYPE_CHECKING:
    from worker.batch.generation import Generation
    from worker.batch.sequence import Sequence, Watch

log = get_task_logger(__name__)
# One INFO line per job even when the worker runs at Celery's default WARNING (`celery worker`
# without --loglevel): a record at this logger's level reaches the task log's handler.
log.setLevel(logging.INFO)
CLAIM_BATCH = 64  # the most delivered jobs claimed in one Redis transaction


class NotRun(Exception):
    """The delivered job must not run (already terminal, or out of attempts)."""


# What `submit`'s callback hears once the job is over: "done" (its outcome is recorded, or it was
# not to run) or "redis" (Redis stayed away past ACTQ_REDIS_OUTAGE_SECONDS: nothing recorded).
Reply = Callable[[str, str], None]
Delivered = tuple[str, Reply, Callable[..., None], Callable[[str], None]]  # submit's arguments


def submit(
    job_id: str,
    reply: Reply,
    started: Callable[..., None] = lambda *_: None,
    storing: Callable[[str], None] = lambda _: None,
) -> None:
    """Queue `job_id` for the engine thread. `started(job_id, limit, attempt)` is called when it
    joins a batch (`limit`: seconds for a job with a hard limit of its own, an nnsight job, else
    None; `attempt`: the claim it runs as), `storing(job_id)` when it has left the batch and only
    writing its files and outcome remain (jobs that write files only), and `reply(job_id, outcome)`
    once it is over; none blocks."""
    _preparer.put((job_id, reply, started, storing))


class _Preparer:
    """One thread of its own (jobs join in the order they came) that claims every job delivered
    meanwhile in one Redis transaction, then tokenizes each and hands it to the engine thread: a
    burst of deliveries joins the running batch together instead of one round trip apart."""

    def __init__(self) -> None:
        self._waiting: queue.SimpleQueue[Delivered] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, item: Delivered) -> None:
        self._waiting.put(item)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="actq-prepare", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        later = None  # a second delivery of a job in the batch: claimed after it, as before
        while True:
            batch = [later or self._waiting.get()]
            later = None
            while len(batch) < CLAIM_BATCH:
                try:
                    item = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if any(item[0] == other[0] for other in batch):
                    later = item
                    break
                batch.append(item)
            try:
                _prepare_many(runtime.get(), batch)
            except Exception:  # this thread must outlive any one batch (each job was answered)
                log.exception("preparing %d jobs failed", len(batch))


_preparer = _Preparer()


def _prepare_many(rt: runtime.Runtime, batch: list[Delivered]) -> None:
    """Claim the jobs of `batch` together, then prepare each in order. Should the claim fail for
    anything but Redis, each job is claimed alone: one job's trouble never holds back the others."""
    ids = [item[0] for item in batch]
    claims: dict[str, Any]
    try:
        claims = rt.jobs.claim_many(ids, rt.worker_id, rt.settings.max_attempts)
    except redis.RedisError as exc:  # Redis stayed away: every job's outcome (_finish answers "redis")
        claims = dict.fromkeys(ids, exc)
    except Exception:
        log.exception("claiming %d jobs together failed; claiming each alone", len(ids))
        claims = {job_id: _claim_alone(rt, job_id) for job_id in ids}
    for job_id, reply, started, storing in batch:
        _prepare(rt, job_id, reply, started, storing, claims[job_id])


def _claim_alone(rt: runtime.Runtime, job_id: str) -> tuple[JobRecord | None, str] | Exception:
    try:
        return rt.jobs.claim(job_id, rt.worker_id, rt.settings.max_attempts)
    except Exception as exc:  # noqa: BLE001 - this job's outcome (_finish logs and records it)
        return exc


def _prepare(
    rt: runtime.Runtime,
    job_id: str,
    reply: Reply,
    started: Callable[..., None],
    storing: Callable[[str], None],
    claim: tuple[JobRecord | None, str] | Exception,
) -> None:
    """Tokenize the claimed `job_id`, then hand it to the engine thread (or answer why not)."""
    holder: dict[str, Any] = {}
    waiting = [1]  # outcomes still to come: the job's, and its unedited run's (`baseline: true`)
    lock = threading.Lock()

    def finished(which: str, outcome: Sequence | Exception) -> None:
        with lock:
            holder[which] = outcome
            waiting[0] -= 1
            if waiting[0]:
                return
        rt.progress.remove(job_id)
        if finishing.writes_files(rt.settings, holder):
            storing(job_id)  # its place in the worker's batch is free while its files are written
            pool = finishing.store_pool(rt.settings)
            pool.submit(finishing.captured_bytes(holder), _finish, rt, job_id, holder, holder["outcome"], reply)
        else:
            finishing.finisher.submit(_finish, rt, job_id, holder, holder["outcome"], reply)

    def done(outcome: Sequence | Exception) -> None:
        finished("outcome", outcome)

    def unedited(outcome: Sequence | Exception) -> None:
        finished("baseline", outcome)

    def joined() -> None:
        holder["joined"] = time.monotonic()  # the time limit counts from here, not from the queue
        started(job_id, None, Attempt.of(holder["record"]))

    try:
        if isinstance(claim, Exception):
            raise claim
        record, why = claim
        if record is None:
            raise NotRun(why)
        holder["record"], holder["started"] = record, time.perf_counter()
        log.info("job %s claimed (attempt %d)", job_id, record.attempts)
        trusted = record.request.nnsight is not None
        own_engine = rt.settings.nnsight_engine == "own"
        if (trusted and own_engine and rt.role == "capture") or (not trusted and rt.role == "nnsight"):
            # trusted code never runs beside other jobs unless the operator chose so (ACTQ_NNSIGHT_ENGINE)
            raise InternalError(
                f"this {'nnsight job' if trusted else 'job'} reached the {rt.role} engine, which does not run it"
            )
        if trusted:  # trusted code: the engine runs it with the model to itself
            from worker.engine import nnsight_io

            hard = nnsight_io.limits(rt.settings, record)[1]

            def alone_started() -> None:
                holder["joined"] = time.monotonic()
                # the worker ends its engine past `hard`, not ACTQ_JOB_TIME_LIMIT
                started(job_id, hard, Attempt.of(record))

            rt.progress.add(job_id)
            rt.core.run_alone(nnsight_io.job(rt, record, done, alone_started))
            return
        watch = _watch(rt, record, holder)
        request, plain = paired(record.request)
        holder["request"], holder["plain"] = request, plain
        refs = None
        if record.edit_points:
            refs = References(rt.jobs, rt.store, record.model, record.owner, record.owner is not None)
        seq = rt.served.prepare(request, record.capture_points, record.max_tokens, watch, record.edit_points, refs)
        twin = None
        if plain is not None:  # the same job without its edits, beside it in the batch
            twin = rt.served.prepare(plain, record.capture_points, record.max_tokens, _watch(rt, record, holder, False))
    except Exception as exc:  # noqa: BLE001 - answered as the job's outcome (_finish logs or records it)
        done(exc)
        return

    def join() -> None:
        streamed = request.stream and not seq.trace  # a trace has no text to publish step by step
        rt.progress.add(job_id, TextStream(rt.served.tokenizer, seq.generated, request.stop) if streamed else None)
        if twin is not None:
            waiting[0] = 2
            rt.core.submit(Entry(seq=twin, done=unedited, estimate=rt.served.estimate(twin), started=lambda: None))
        rt.core.submit(Entry(seq=seq, done=done, estimate=rt.served.estimate(seq), started=joined))

    if record.capture_points:  # its activations go to the store: it waits while too many jobs' files do
        finishing.store_pool(rt.settings).admit(job_id, join, finishing.captured(seq) + finishing.captured(twin))
    else:
        join()


def paired(request: JobRequest) -> tuple[JobRequest, JobRequest | None]:
    """The job's request as it runs and, for `baseline: true`, the same request without its
    interventions. A sampled pair draws from one seed (chosen here when the request has none),
    so the two texts differ by the edits alone."""
    if not request.baseline:
        return request, None
    if request.samples and request.seed is None:
        request = request.model_copy(update={"seed": int.from_bytes(os.urandom(7), "little")})
    return request, request.model_copy(update={"interventions": None, "baseline": False})


def _finish(rt: runtime.Runtime, job_id: str, holder: dict, outcome: Sequence | Exception, reply: Reply) -> None:
    answer = "done"
    try:
        if isinstance(outcome, NotRun):
            log.info("job %s not run: %s", job_id, outcome)
        elif isinstance(outcome, redis.RedisError):
            log.error("job %s: it could not be claimed; Redis is unreachable", job_id)
            answer = "redis"
        elif "record" not in holder:  # its claim raised: the job never ran
            _unclaimed(rt, job_id, outcome)
        else:
            _record(rt, holder["record"], holder["started"], outcome, holder)
    except redis.RedisError:  # Redis stayed away past ACTQ_REDIS_OUTAGE_SECONDS: the broker redelivers the job
        log.error("job %s: its outcome could not be recorded; Redis is unreachable", job_id)
        answer = "redis"
    except Exception:
        log.exception("job %s: recording its outcome failed", job_id)
    finally:
        release_memory_soon()  # the heap given back now, or within 0.5 s when jobs end faster
        reply(job_id, answer)


def _unclaimed(rt: runtime.Runtime, job_id: str, outcome: Sequence | Exception) -> None:
    """A job whose claim raised (a bug, or a record no check foresaw): the cause is logged with its
    traceback, and the job ends failed, once, with it (its message is acknowledged: left as it is,
    it would be sent again and fail the same way, forever)."""
    log.error("job %s: claiming it failed", job_id, exc_info=outcome if isinstance(outcome, Exception) else None)
    cause = f"{type(outcome).__name__}: {str(outcome)[:500]}"
    rt.jobs.fail(job_id, InternalError(f"the worker could not claim this job ({cause})"))


def _record(
    rt: runtime.Runtime, record: JobRecord, started: float, outcome: Sequence | Exception, holder: dict | None = None
) -> None:
    job_id = record.id
    holder = holder or {}
    attempt = Attempt.of(record)
    generation: Generation | None = None
    try:
        if record.request.nnsight is not None:
            from worker.engine import nnsight_io

            nnsight_io.flush_logs(job_id)  # its LOG statuses come before its last one
        if isinstance(outcome, BaseException):
            raise outcome
        if record.request.nnsight is not None:
            stored = nnsight_io.record(rt, record, outcome, attempt)  # type: ignore[arg-type]  # an nnsight Outcome
            log.info("job %s (nnsight) succeeded: run %.1f ms, %d bytes saved", job_id, _ms(started), stored)
            attempt_files.tidy(rt.store, job_id, attempt, succeeded=True)
            return
        generation = rt.served.finish(outcome, holder.get("request", record.request))
        if generation.stopped_by is not None:
            _stopped(rt, record, generation)
            return
        baseline = None
        if "baseline" in holder:  # `baseline: true`: the unedited run fails the job as its own would
            if isinstance(holder["baseline"], Exception):
                raise holder["baseline"]
            baseline = rt.served.finish(holder["baseline"], holder["plain"])
        generated = time.perf_counter()
        inline = generation.scores is None or len(generation.scores.values) <= rt.settings.logprobs_inline_tokens
        if baseline is not None and baseline.scores is not None:
            inline = inline and len(baseline.scores.values) <= rt.settings.logprobs_inline_tokens
        with rt.served.gate.reading():  # its tokens decoded: never while trusted code runs on this model
            result = job_result(generation, tokenizer=rt.served.tokenizer, inline=inline)
            unedited = job_result(baseline, tokenizer=rt.served.tokenizer, inline=inline) if baseline else None
        if baseline is not None:
            assert unedited is not None
            result.baseline = BaselineResult(
                text=unedited.text,
                finish_reason=unedited.finish_reason,
                usage=unedited.usage,
                logprobs=unedited.logprobs,
            )
        if record.capture_points and rt.settings.store_process:
            _store_elsewhere(rt, record, generation, baseline, result.model_dump(), (started, generated))
            return
        manifest = None
        if record.capture_points or not inline:
            from worker.results.artifacts import write_activations

            manifest = write_activations(
                rt.store,
                record.id,
                record.model,
                record.request.capture,
                generation,
                baseline,
                prefix=attempt.prefix(record.id),
            )
        rt.jobs.succeed(
            record.id,
            result.model_dump(),
            manifest.model_dump() if manifest is not None else None,
            rt.settings.result_inline_bytes,
            attempt=attempt,
        )
        log.info(
            "job %s succeeded: %d prompt + %d new tokens, run %.1f ms, store %.1f ms, %d bytes stored",
            record.id,
            generation.prompt_tokens,
            generation.completion_tokens,
            (generated - started) * 1e3,
            (time.perf_counter() - generated) * 1e3,
            manifest.bytes if manifest is not None else 0,
        )
        attempt_files.tidy(rt.store, job_id, attempt, succeeded=True)
    except StaleAttempt as lost:
        attempt_files.discard(rt.store, record.id, lost)
    except CancelAsked:  # asked after its last step, before its success was recorded: the cancel wins
        _cancelled_at_its_end(rt, record, generation)
    except JobFailure as exc:
        _fail(rt, record, exc)
    except redis.RedisError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure ends the job, never the worker
        _fail(rt, record, failure_of(exc))


def _store_elsewhere(
    rt: runtime.Runtime,
    record: JobRecord,
    generation: Generation,
    baseline: Generation | None,
    result: dict,
    times: tuple[float, float],
) -> None:
    """A capture job's file stored and its success recorded by the store process (ACTQ_STORE_PROCESS,
    worker/results/store_process.py); its failures raise here as `_record` maps them."""
    from worker.results import store_client
    from worker.results.artifacts import capture_file

    attempt = Attempt.of(record)
    file = capture_file(record.id, record.model, record.request.capture, generation, baseline)
    meta = {
        "model": record.model,
        "attempt": [attempt.number, attempt.worker],
        "metadata": file.metadata,
        "entries": file.entries,
        "extra": file.extra,
        "result": result,
    }
    stored = store_client.process_for(rt.settings).store(record.id, meta, file)
    if stored is None:  # the attempt had lost the job: the store process removed its files and logged it
        return
    log.info(
        "job %s succeeded: %d prompt + %d new tokens, run %.1f ms, store %.1f ms, %d bytes stored",
        record.id,
        generation.prompt_tokens,
        generation.completion_tokens,
        (times[1] - times[0]) * 1e3,
        (time.perf_counter() - times[1]) * 1e3,
        stored,
    )


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


def time_limit(settings_limit: float, record: JobRecord) -> float:
    """The request's time_limit, never more than the deployment's ACTQ_JOB_SOFT_TIME_LIMIT."""
    return min(settings_limit, record.request.time_limit or float("inf"))


def _watch(rt: runtime.Runtime, record: JobRecord, holder: dict[str, Any], counts: bool = True) -> Watch:
    """Asked by the engine thread after every decoding step: stop for the job's time limit
    (counted from when it joined a batch) or a cancel flag (read by the progress thread, see
    worker/engine/progress.py: no Redis call here). `counts`: its token count is the job's progress
    (not for the unedited twin of a `baseline: true` job)."""
    limit = time_limit(rt.settings.job_soft_time_limit, record)

    def watch(generated_tokens: int) -> str | None:
        joined = holder.get("joined")
        if joined is not None and time.monotonic() - joined >= limit:
            return "timeout"
        return "cancelled" if rt.progress.update(record.id, generated_tokens if counts else None) else None

    return watch


def _cancelled_at_its_end(rt: runtime.Runtime, record: JobRecord, generation: Generation | None) -> None:
    """A cancel the API accepted (202) while the job ran, first seen by the transaction that would
    have recorded its success (the job ended within the progress thread's round): it ends
    `cancelled` as a watched cancel does, with its text; the files it wrote are removed."""
    attempt = Attempt.of(record)
    attempt_files.withdraw(rt.store, record.id, attempt)
    try:
        if generation is None:  # an nnsight job: its saves go with its files
            rt.jobs.fail(record.id, JobCancelled("cancelled while running, as its code ended"), attempt=attempt)
        else:
            _stopped(rt, record, dataclasses.replace(generation, stopped_by="cancelled"))
    except StaleAttempt as lost:
        attempt_files.discard(rt.store, record.id, lost)


def _stopped(rt: runtime.Runtime, record: JobRecord, generation: Generation) -> None:
    """A generation the watch ended: cancelled (with what it had written) or out of time."""
    tokens = generation.completion_tokens
    failure: JobFailure
    if generation.stopped_by == "cancelled":
        failure = JobCancelled(f"cancelled while running, after {tokens} tokens")
    else:
        limit = time_limit(rt.settings.job_soft_time_limit, record)
        failure = JobTimeout(f"the job ran past its time limit of {limit:g}s (after {tokens} tokens)")
    partial = job_result(generation, failure.error_type).model_dump()
    rt.jobs.fail(
        record.id, failure, result=partial, inline_bytes=rt.settings.result_inline_bytes, attempt=Attempt.of(record)
    )
    attempt_files.tidy(rt.store, record.id, Attempt.of(record), succeeded=False)
    log.info("job %s ended %s after %d tokens", record.id, failure.error_type, tokens)


def _fail(rt: runtime.Runtime, record: JobRecord, exc: JobFailure) -> None:
    log.warning("job %s failed: %s: %s", record.id, exc.error_type, exc.message)
    try:
        rt.jobs.fail(record.id, exc, attempt=Attempt.of(record))
    except StaleAttempt as lost:
        attempt_files.discard(rt.store, record.id, lost)
        return
    attempt_files.tidy(rt.store, record.id, Attempt.of(record), succeeded=False)

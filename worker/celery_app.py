"""The worker's Celery app: `celery -A worker.celery_app worker`.

Shape: the Celery worker process runs a threads pool of ACTQ_MAX_BATCH task threads and starts
one engine process (engine_process.py) that loads the model once and runs every job in its
scheduler's batches. A task hands its job id to the engine and waits for that job to end, so each
message is acknowledged when its own job ends (late ack), and up to ACTQ_MAX_BATCH jobs are taken
from the queue at once. The worker process itself never imports torch: its main thread stays free
to answer control commands (`inspect ping`), send heartbeats and task events while the engine
computes, and a kill -9 of the engine process loses no job (engine_client.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery.exceptions import Reject
from celery.platforms import EX_FAILURE
from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down

from shared import keys
from shared.attempts import Attempt, StaleAttempt
from shared.broker import check_timeouts, make_celery
from shared.errors import InternalError, JobFailure, JobTimeout, NnsightCodeFailed
from shared.jobs import JobStore
from shared.settings import get_settings
from worker.engine_client import EngineClient, EngineStartFailed
from worker.lost_messages import LostMessageSweeper

settings = get_settings()
check_timeouts(settings)
app = make_celery(settings)
app.conf.update(
    worker_pool="threads",
    worker_concurrency=settings.max_batch,
    broker_transport="worker.broker_transport:Transport",  # survives Redis restarts mid-fetch
    broker_transport_options={
        **app.conf.broker_transport_options,
        "ack_outage_seconds": settings.redis_outage_seconds,  # acks wait an outage out like records
    },
)
engine = EngineClient(start_timeout=settings.worker_start_timeout)
# Trusted nnsight code on a model copy of its own (ACTQ_NNSIGHT_ENGINE=own), started at its first job.
nnsight_engine = EngineClient(
    start_timeout=settings.worker_start_timeout, role="nnsight", lazy=True, idle_seconds=settings.nnsight_idle_seconds
)
log = logging.getLogger("actq.worker")
_sweepers: list[LostMessageSweeper] = []
_holding: set[str] = set()  # job ids whose task is running in this worker
_holding_lock = threading.Lock()  # the pool's task threads check and add together
_stores: list[JobStore] = []  # this process's job store (built at first use: no Redis at import)


@app.task(name=keys.TASK_NAME, ignore_result=True)
def run_job(job_id: str) -> None:
    """The task: its message carries only the job id; the request lives in the job's record."""
    with _holding_lock:
        if job_id in _holding:  # a second delivery while a task of ours runs it: drop (ack) this copy
            log.warning(
                "job %s: its message was delivered again while this worker runs it (kombu restores a channel's "
                "unacknowledged messages when it reconnects); this copy is dropped, the first one goes on",
                job_id,
            )
            return
        _holding.add(job_id)  # published for the lost-message check: this message is not stranded
    try:
        runs_on = _engine_for(job_id)
        outcome = "redis" if runs_on is None else runs_on.run(job_id, time_limit=settings.job_time_limit)
    finally:
        _holding.discard(job_id)
    if outcome == "lost":  # the engine died with the job: back to the queue (the next attempt counts)
        raise Reject("the engine process was lost", requeue=True)
    if outcome == "requeue":  # another job's trusted code ended the engine: back, not counted against it
        assert runs_on is not None
        _store().forgive(job_id, _attempt(runs_on.requeued.pop(job_id, None)))
        raise Reject("the engine process was ended by another job", requeue=True)
    if outcome == "redis":  # its outcome could not be recorded: it runs again (acked, it would stay `running`)
        raise Reject(f"job {job_id}: Redis is unreachable; its outcome is not recorded", requeue=True)
    assert runs_on is not None
    if outcome == "timeout":
        limit, attempt = runs_on.stopped_at.pop(job_id, (settings.job_time_limit, None))
        _fail(job_id, JobTimeout(f"the job was stopped at the hard time limit of {limit:g}s"), attempt)
    elif outcome == "killed":  # its own trusted code ended its engine: failed, never delivered again
        how, attempt = runs_on.ended.pop(job_id, ("it ended", None))
        failure = NnsightCodeFailed(
            f"the nnsight job's code ended the engine process running it ({how}); it is not run again. A "
            "process ends this way when the code exits it, kills it, or takes more memory than it may have "
            "(ACTQ_NNSIGHT_MAX_HOST_BYTES, ACTQ_NNSIGHT_MEMORY_FRACTION, the kernel's OOM killer)"
        )
        _fail(job_id, failure, attempt)
    elif outcome == "unavailable":
        why, _ = runs_on.ended.pop(job_id, ("unknown", None))
        _fail(job_id, InternalError(f"the worker's nnsight engine could not start ({why}); try again later"), None)


def _attempt(attempt: tuple[int, str | None] | None) -> Attempt | None:
    return Attempt(*attempt) if attempt is not None else None


def _fail(job_id: str, failure: JobFailure, attempt: tuple[int, str | None] | None) -> None:
    """Fail the job the engine ran, if it is still the attempt the engine ran (it may have been
    claimed again meanwhile by another worker, whose outcome then stands)."""
    try:
        _store().fail(job_id, failure, attempt=_attempt(attempt))
    except StaleAttempt as lost:
        log.warning("%s; its %s is not recorded", lost, failure.error_type)


def _store() -> JobStore:
    if not _stores:
        import redis

        client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
        _stores.append(JobStore(client, settings.job_retention_seconds, settings.redis_outage_seconds))
    return _stores[0]


def _engine_for(job_id: str) -> EngineClient | None:
    """The engine that runs `job_id`: the nnsight engine for trusted code when it has its own
    (ACTQ_NNSIGHT_ENGINE=own), else the capture engine. Its record says which (one GET, through a
    Redis outage like every job store call). None: Redis stayed away."""
    if settings.nnsight_engine != "own":
        return engine
    import redis

    try:
        return nnsight_engine if _store().is_nnsight(job_id) else engine
    except redis.RedisError:
        log.error("job %s: its record could not be read; Redis is unreachable", job_id)
        return None


@worker_init.connect
def _start_engine(**_: object) -> None:
    log.info("loading model %s (batches of up to %d jobs)", settings.model, settings.max_batch)
    try:
        engine.start()
    except EngineStartFailed:
        # The engine process logged why. Stop with exit 1: a supervisor sees a failed worker.
        log.critical("cannot serve model %s; stopping the worker", settings.model, exc_info=True)
        os._exit(EX_FAILURE)


def _start_lost_message_checks() -> LostMessageSweeper:
    import redis

    from shared.broker import task_message

    model = settings.served_model_name
    queue = keys.queue(model)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
    sweeper = LostMessageSweeper(
        client,
        model,
        queue,
        lambda job_id: task_message(app, job_id, queue),
        interval=settings.lost_message_check_seconds,
        confirm=settings.lost_message_check_seconds,
        worker_id=f"{socket.gethostname()}:{os.getpid()}",
        holding=lambda: set(_holding),
        publish_every=settings.heartbeat_interval,  # this worker's holdings live as long as a heartbeat
        held_ttl=settings.heartbeat_ttl,
    )
    sweeper.start()
    return sweeper


@worker_ready.connect
def _checks(**_: object) -> None:
    _sweepers.append(_start_lost_message_checks())


@worker_shutting_down.connect
def _shutting_down(**_: object) -> None:
    # A SIGTERM or Ctrl-C sent to the worker's process group reaches the engine processes too: they
    # end, their jobs go back to the queue, and they must not be restarted while the worker stops.
    engine.closing()
    nnsight_engine.closing()
    for sweeper in _sweepers:
        sweeper.stop.set()


@worker_shutdown.connect
def _stop_engine(**_: object) -> None:
    engine.close()
    nnsight_engine.close()

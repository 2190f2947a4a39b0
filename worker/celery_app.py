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
from shared.broker import check_timeouts, make_celery
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
log = logging.getLogger("actq.worker")
_sweepers: list[LostMessageSweeper] = []
_holding: set[str] = set()  # job ids whose task is running in this worker
_holding_lock = threading.Lock()  # the pool's task threads check and add together


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
        outcome = engine.run(job_id, time_limit=settings.job_time_limit)
    finally:
        _holding.discard(job_id)
    if outcome == "lost":  # the engine died with the job: back to the queue (the next attempt counts)
        raise Reject("the engine process was lost", requeue=True)
    if outcome == "redis":
        raise RuntimeError(f"job {job_id}: Redis is unreachable; its outcome is not recorded")
    if outcome == "timeout":
        _record_hard_timeout(job_id, *engine.stopped_at.pop(job_id, (settings.job_time_limit, None)))


def _record_hard_timeout(job_id: str, limit: float, attempt: tuple[int, str | None] | None) -> None:
    """Fail the job the engine was stopped for, if it is still the attempt the engine ran (it
    may have been claimed again meanwhile by another worker, whose outcome then stands)."""
    import redis

    from shared.attempts import Attempt, StaleAttempt
    from shared.errors import JobTimeout
    from shared.jobs import JobStore

    client = redis.Redis.from_url(settings.redis_url)
    try:
        store = JobStore(client, settings.job_retention_seconds, settings.redis_outage_seconds)
        failure = JobTimeout(f"the job was stopped at the hard time limit of {limit:g}s")
        store.fail(job_id, failure, attempt=Attempt(*attempt) if attempt is not None else None)
    except StaleAttempt as lost:
        log.warning("%s; its timeout is not recorded", lost)
    finally:
        client.close()


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
    from shared.registry import ModelRegistry

    model = settings.served_model_name
    queue = keys.queue(model)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
    registry = ModelRegistry(client, settings.heartbeat_ttl)
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
        live_engines=lambda: set(registry.live_workers(model)),
    )
    sweeper.start()
    return sweeper


@worker_ready.connect
def _checks(**_: object) -> None:
    _sweepers.append(_start_lost_message_checks())


@worker_shutting_down.connect
def _shutting_down(**_: object) -> None:
    # A SIGTERM or Ctrl-C sent to the worker's process group reaches the engine process too: it
    # ends, its jobs go back to the queue, and it must not be restarted while the worker stops.
    engine.closing()
    for sweeper in _sweepers:
        sweeper.stop.set()


@worker_shutdown.connect
def _stop_engine(**_: object) -> None:
    engine.close()

"""The worker's Celery app: `celery -A worker.celery_app worker`.

Shape: the Celery worker process runs a threads pool of 2 x ACTQ_MAX_BATCH + ACTQ_READY_JOBS task
threads and starts one engine process (worker/engine/process.py) that loads the model once and
runs every job in its scheduler's batches. A task hands its job id to the engine and waits for that
job to end, so each message is acknowledged when its own job ends (late ack). Up to ACTQ_MAX_BATCH
+ ACTQ_READY_JOBS jobs are taken from the queue at once (a batch, and any jobs ready to take a
place as it frees), and one more for each job that has left its batch and is writing its files,
up to a batch's worth (worker/storing_room.py).
The worker process itself never imports torch: its main thread stays free to answer control
commands (`inspect ping`), send heartbeats and task events while the engine computes, and a kill
-9 of the engine process loses no job (worker/engine_client.py).

Its name. Each worker is a Celery node of its own: without `-n`, it is named
`actq-<model>-<6 hex>@<host>` (`-gpu<N>` after the model when CUDA_VISIBLE_DEVICES names one
device), never Celery's `celery@<host>`, which two workers on one machine would share (Flower
and `celery inspect` would see one). The node name is also the worker's name in Redis: its
heartbeat, the jobs it claims (`worker` in GET /jobs/{id}) and its figures in /metrics. Workers
run without mingle and gossip (each would otherwise talk to every other node at start and on
every event); Flower and `celery inspect` do not need them.

What monitors see of a job: the task ends as the job did. A failed job's task fails (Flower:
FAILURE, the job's error type and message as its exception), a cancelled job's is revoked
(REVOKED), any other ends SUCCESS; the job's own record and error handling are unchanged, and
the message is acknowledged either way (a failed task is not retried).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
import warnings
from typing import Any

from celery import Task
from celery.exceptions import CPendingDeprecationWarning, Ignore, Reject
from celery.platforms import EX_FAILURE
from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down
from celery.utils.nodenames import default_nodename, host_format

from shared import keys
from shared.attempts import Attempt, StaleAttempt
from shared.broker import check_timeouts, make_celery
from shared.errors import InternalError, JobFailure, JobTimeout, NnsightCodeFailed, WorkerLost
from shared.jobs import JobStore
from shared.outages import ReconnectLines, quiet_retries
from shared.registry import ModelRegistry
from shared.schemas import JobStatus
from shared.settings import Settings, get_settings
from worker.engine_client import EngineClient, EngineStartFailed
from worker.lost_messages import LostMessageSweeper
from worker.storing_room import StoringRoom, consumer_step


def places(settings: Settings) -> int:
    """The jobs a worker holds in its engine before they are decoded: a batch's worth and the jobs
    ready to take a place as it frees (ACTQ_READY_JOBS). Its prefetch while nothing is storing."""
    return settings.max_batch + settings.ready_jobs


def task_threads(settings: Settings) -> int:
    """The pool's task threads, each holding one job until it ends: the places, and room for a
    batch's worth of jobs whose files are being written (worker/storing_room.py)."""
    return places(settings) + settings.max_batch


settings = get_settings()
check_timeouts(settings)
app = make_celery(settings)
app.conf.update(
    worker_pool="threads",
    worker_concurrency=task_threads(settings),
    # after a lost connection the storing room leaves room for the tasks still running, and gives
    # it back as each ends; Celery's own reduction would give back the whole pool's threads
    worker_enable_prefetch_count_reduction=False,
    broker_transport="worker.broker_transport:Transport",  # survives Redis restarts mid-fetch
    broker_transport_options={
        **app.conf.broker_transport_options,
        "ack_outage_seconds": settings.redis_outage_seconds,  # acks wait an outage out like records
    },
)
storing_room = StoringRoom(places=places(settings), room=settings.max_batch)
app.steps["consumer"].add(consumer_step(storing_room))
engine = EngineClient(start_timeout=settings.worker_start_timeout, on_storing=storing_room.changed)
# Trusted nnsight code on a model copy of its own (ACTQ_NNSIGHT_ENGINE=own), started at its first job.
nnsight_engine = EngineClient(
    start_timeout=settings.worker_start_timeout, role="nnsight", lazy=True, idle_seconds=settings.nnsight_idle_seconds
)
log = logging.getLogger("actq.worker")
_sweepers: list[LostMessageSweeper] = []
_holding: set[str] = set()  # job ids whose task is running in this worker
_holding_lock = threading.Lock()  # the pool's task threads check and add together
_stores: list[JobStore] = []  # this process's job store (built at first use: no Redis at import)
CELERY_DEFAULT_NODE = host_format(default_nodename(None))  # `celery@<host>`: what Celery names a worker without -n
_node: list[str] = []  # this worker's node name, once Celery has named it (worker_init)


def node_name(model: str, gpus: str | None = None) -> str:
    """A worker's default node name: `actq-<model>[-gpu<N>]-<6 hex>@<host>`, unique per process."""
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-") or "model"
    if gpus and re.fullmatch(r"[0-9A-Za-z-]+", gpus):  # one device (an index or a GPU-... uuid)
        tag += f"-gpu{gpus}"
    return host_format(f"actq-{tag}-{uuid.uuid4().hex[:6]}@%h")


class Worker(app.Worker):  # type: ignore[name-defined]  # Celery builds the class per app
    """`celery worker` for actq: its own node name when `-n` gives none, no mingle, no gossip."""

    def __init__(self, hostname: str | None = None, **options: Any) -> None:
        if hostname in (None, CELERY_DEFAULT_NODE):
            hostname = node_name(settings.served_model_name, os.environ.get("CUDA_VISIBLE_DEVICES"))
        super().__init__(hostname=hostname, **{**options, "without_mingle": True, "without_gossip": True})


app.Worker = Worker


class JobFailed(Exception):
    """The job ended `failed`: its task fails with the job's error type and message."""


@app.task(name=keys.TASK_NAME, ignore_result=True, bind=True, throws=(JobFailed,))
def run_job(task: Task, job_id: str) -> None:
    """The task: its message carries only the job id; the request lives in the job's record. It
    ends as the job did (module docstring)."""
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
        storing_room.task_ended(task.request.id)
    if outcome == "lost":  # the engine died with the job: back to the queue (the next attempt counts)
        assert runs_on is not None
        how, attempt = runs_on.ended.pop(job_id, ("it ended", None))
        if not _lost_for_good(job_id, how, attempt):
            raise Reject(f"the engine process was lost ({how})", requeue=True)
    if outcome == "requeue":  # another job's trusted code ended the engine: back, not counted against it
        assert runs_on is not None
        runs_on.ended.pop(job_id, None)
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
    _end_as_the_job(task, job_id)


def _end_as_the_job(task: Task, job_id: str) -> None:
    """Failed: raise JobFailed (an expected exception: logged at INFO without a traceback, the
    message acknowledged). Cancelled: a `task-revoked` event, then Ignore (acknowledged, no other
    event). Anything else, or a record that cannot be read now (Redis away): the task succeeds."""
    ended = _final_state(job_id)
    if ended is None:
        return
    status, error = ended
    if status == "failed":
        raise JobFailed(f"{error.get('type', 'job_failed')}: {str(error.get('message', ''))[:300]}")
    if status == "cancelled":
        try:
            task.send_event("task-revoked", retry=False, terminated=False, signum=None, expired=False)
        except Exception as exc:  # noqa: BLE001 - a monitor's event is best effort (Redis away: lost, like any)
            log.debug("job %s: its task-revoked event was not sent: %s", job_id, exc)
        raise Ignore()


def _final_state(job_id: str) -> tuple[str, dict[str, Any]] | None:
    """The job's status and error as its record holds them, when it ended failed or cancelled (one
    GET, no wait through an outage); None otherwise."""
    import redis

    try:
        raw = _store().redis.get(keys.job(job_id))
        record = json.loads(raw) if raw is not None else None
    except (redis.RedisError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") not in ("failed", "cancelled"):
        return None
    error = record.get("error")
    return str(record["status"]), error if isinstance(error, dict) else {}


def _lost_for_good(job_id: str, how: str, attempt: tuple[int, str | None] | None) -> bool:
    """The engine running `job_id` ended (`how`: its exit status and the reason it gave). On the
    job's last allowed attempt (ACTQ_MAX_ATTEMPTS), fail it as `worker_lost` with that reason (its
    error says why, not only how many times) and return True; else False: it goes back to the queue
    (the engine client's log line says why; the next claim fails it, without the reason, when
    this worker could not)."""
    try:
        record = _store().get(job_id)
    except Exception as exc:  # noqa: BLE001 - Redis away, a record of a newer version: the claim judges it
        log.warning("job %s: its record could not be read (%s)", job_id, exc)
        record = None
    if attempt is None and record is not None and record.worker in _node:
        attempt = (record.attempts, record.worker)  # claimed by the engine, not yet in a batch; or not claimed again
    if record is None or record.status is not JobStatus.running or attempt is None:
        return False
    counted = record.attempts - record.forgiven_attempts
    if counted < settings.max_attempts or not Attempt(*attempt).holds(record):
        return False
    failure = WorkerLost(f"the engine process running this job ended ({how}); it was lost {counted} times; giving up")
    _fail(job_id, failure, attempt)
    return True


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


def _registry() -> ModelRegistry:
    return ModelRegistry(_store().redis, settings.heartbeat_ttl)


@worker_init.connect
def _start_engine(sender: Any = None, **_: object) -> None:
    _node.append(getattr(sender, "hostname", None) or node_name(settings.served_model_name))
    engine.node = nnsight_engine.node = _node[0]  # the engines claim jobs and beat under this name
    # A Redis outage is logged once when it starts and once when it ends (shared/outages.py), not by
    # every reconnection attempt of the consumer, every retried ack or every retried job store call.
    quiet_retries()
    logging.getLogger("celery.worker.consumer.consumer").addFilter(ReconnectLines())
    log.info("loading model %s as %s (batches of up to %d jobs)", settings.model, _node[0], settings.max_batch)
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
        worker_id=_node[0],
        holding=lambda: set(_holding),
        publish_every=settings.heartbeat_interval,  # this worker's holdings live as long as a heartbeat
        held_ttl=settings.heartbeat_ttl,
    )
    sweeper.start()
    return sweeper


@worker_ready.connect
def _checks(**_: object) -> None:
    _sweepers.append(_start_lost_message_checks())
    # Nor is an outage logged by Celery 5's notice, at each connection loss, of a setting whose
    # default Celery 6 changes (worker_cancel_long_running_tasks_on_connection_loss: actq keeps its
    # running jobs through an outage). Here: Celery's logging setup, before, shows every such warning.
    warnings.filterwarnings("ignore", message=r"\s*In Celery 5.1 we introduced", category=CPendingDeprecationWarning)


def _leave_live_workers() -> None:
    """This worker no longer counts as live for its model (GET /health, /metrics): at once, not
    when its last heartbeat expires. Best effort: a Redis away leaves it to the heartbeat TTL."""
    import redis

    if not _node:
        return
    try:
        _registry().remove_worker(settings.served_model_name, _node[0])
    except redis.RedisError as exc:
        log.warning("could not leave the live workers (%s): this worker leaves when its heartbeat expires", exc)


@worker_shutting_down.connect
def _shutting_down(**_: object) -> None:
    # A SIGTERM or Ctrl-C sent to the worker's process group reaches the engine processes too: they
    # end, their jobs go back to the queue, and they must not be restarted while the worker stops.
    # An engine that is still running (a SIGTERM to this process alone: a warm shutdown that lets
    # running jobs finish) stops its heartbeat: a stopping worker takes no new job.
    engine.closing()
    nnsight_engine.closing()
    for sweeper in _sweepers:
        sweeper.stop.set()
    _leave_live_workers()


@worker_shutdown.connect
def _stop_engine(**_: object) -> None:
    engine.close()
    nnsight_engine.close()
    _leave_live_workers()  # again: a heartbeat sent while the worker was stopping counts no more

"""The worker's Celery app: `celery -A worker.celery_app worker`.

Pool: prefork with concurrency 1. The child loads the model once (worker_process_init) and runs
one job at a time; the parent stays free to answer control commands (`inspect ping`), send
heartbeats and events while a job runs, which the solo pool cannot do. Nothing here computes
with torch in the parent: a torch op before the fork can hang the child's first generate.
"""

from __future__ import annotations

import logging
import os
import signal

from celery.exceptions import TimeLimitExceeded
from celery.platforms import EX_FAILURE
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutting_down

from shared import keys
from shared.broker import check_timeouts, make_celery
from shared.settings import get_settings

settings = get_settings()
check_timeouts(settings)
app = make_celery(settings)
app.conf.update(
    worker_pool="prefork",
    worker_concurrency=1,
    worker_proc_alive_timeout=settings.worker_start_timeout,
    worker_max_tasks_per_child=None,
)


class JobTask(app.Task):  # type: ignore[name-defined]  # Celery builds each app's Task base at runtime
    def on_failure(self, exc: Exception, task_id: str, args: object, kwargs: object, einfo: object) -> None:
        """Runs in the parent when the hard time limit killed the child: record the job as failed."""
        if isinstance(exc, TimeLimitExceeded):
            import redis

            from shared.errors import JobTimeout
            from shared.jobs import JobStore

            client = redis.Redis.from_url(settings.redis_url)
            try:
                store = JobStore(client, settings.job_retention_seconds, settings.redis_outage_seconds)
                store.fail(
                    task_id, JobTimeout(f"the job was killed at the hard time limit of {settings.job_time_limit:g}s")
                )
            finally:
                client.close()


@app.task(name=keys.TASK_NAME, ignore_result=True, base=JobTask)
def run_job(job_id: str) -> None:
    """The task: its message carries only the job id; the request lives in the job's record."""
    from worker import runner

    runner.run(job_id)


_controller: list[object] = []  # the parent's WorkController, to give its exit code


@worker_init.connect
def _remember_controller(sender: object, **_: object) -> None:
    _controller[:] = [sender]


@worker_shutting_down.connect
def _cold_shutdown_fails(sig: str, how: str, **_: object) -> None:
    """Celery documents a cold shutdown (SIGQUIT) as exiting EX_FAILURE but its terminate path
    exits 0; a child that cannot load the model asks for a cold shutdown, so set the code here."""
    if how == "Cold" and _controller:
        _controller[0].exitcode = EX_FAILURE  # type: ignore[attr-defined]  # a WorkController


@worker_process_init.connect
def _load_model(**_: object) -> None:
    from worker import runtime

    log = logging.getLogger("actq.worker")
    log.info("loading model %s", settings.model)
    try:
        runtime.start(settings)
    except Exception:
        # Celery only logs a signal handler's exception and would go on consuming with no model;
        # stop the whole worker instead, with the reason in the log. SIGQUIT is Celery's cold
        # shutdown, which exits 1 (SIGTERM's warm shutdown exits 0: a supervisor would see a
        # clean exit and not report or restart it as failed).
        log.critical("cannot serve model %s; stopping the worker", settings.model, exc_info=True)
        os.kill(os.getppid(), signal.SIGQUIT)
        os._exit(1)


@worker_process_shutdown.connect
def _unpublish(**_: object) -> None:
    from worker import runtime

    runtime.stop()

"""The Celery app both sides build: JSON only, Redis broker, no result backend (Redis JobRecords are
the job database), late ack, and a broker visibility timeout longer than the hard time limit."""

from __future__ import annotations

from celery import Celery

from shared import keys
from shared.settings import Settings


def make_celery(settings: Settings) -> Celery:
    app = Celery("actq", broker=settings.redis_url)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_track_started=False,
        worker_prefetch_multiplier=1,
        task_send_sent_event=True,
        worker_send_task_events=True,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # Look for messages of dead workers (unacked past the visibility timeout) every tenth of
            # it, at most every 10 s; kombu's default looks about every 100 s.
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout // 10)),
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        task_default_queue=keys.queue(settings.served_model_name),
        task_time_limit=settings.job_time_limit,
        task_soft_time_limit=settings.job_soft_time_limit,
        worker_hijack_root_logger=False,
    )
    return app


def check_timeouts(settings: Settings) -> None:
    """Refuse to run a worker whose jobs could be redelivered while they still run."""
    if settings.visibility_timeout <= settings.job_time_limit:
        raise SystemExit(
            f"ACTQ_VISIBILITY_TIMEOUT ({settings.visibility_timeout}s) must exceed ACTQ_JOB_TIME_LIMIT "
            f"({settings.job_time_limit}s): otherwise Redis redelivers a job while it is still running"
        )

"""Celery as both sides use it: the app's configuration, and a job's broker message.

The app: JSON only, Redis broker, no result backend (Redis JobRecords are the job database), late
ack, and a broker visibility timeout longer than the hard time limit.

The message. Celery's `send_task` would publish through kombu in a round trip of its own after the
record is written: an API process dying between the two would leave a job that is queued on paper
with no message to run it, and the publish costs about a quarter of the API's CPU per job. Instead
the API builds the message with Celery's own `create_task_message` and kombu's serializer, and the
record's MULTI pushes it onto the model's queue list exactly as kombu's Redis transport does
(`JobStore.enqueue`): a job is recorded and queued together or not at all. The envelope is kombu's
Redis transport format (kombu is pinned); tests/shared/test_broker.py compares it field by field
with what `send_task` itself writes, so an upgrade that changes it fails the build.

What monitors show. The message carries only the job id (`run_job(job_id)`), but Celery's task
events and Flower show its `argsrepr`/`kwargsrepr` headers: the job's model, kind, the start of
its prompt and its run label go there (`shown`), so an operator can tell jobs apart in Flower
while the request itself stays in Redis.
"""

from __future__ import annotations

import base64
import json
import uuid

from celery import Celery
from kombu.serialization import dumps

from shared import keys
from shared.errors import ConfigurationError
from shared.listing import RUN_KEY
from shared.schemas import JobRecord
from shared.settings import Settings

PERSISTENT = 2  # kombu's delivery_mode for durable messages
SHOWN_PROMPT_CHARS = 60  # of a job's prompt, in what monitors show of its message


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
            # The lanes of a model's queue (shared/keys.py's `lanes`), popped first to last.
            "priority_steps": list(keys.PRIORITY_STEPS),
            "sep": keys.PRIORITY_SEP,
        },
        broker_connection_retry_on_startup=True,
        task_default_queue=keys.queue(settings.served_model_name),
        worker_hijack_root_logger=False,
    )
    return app


def check_timeouts(settings: Settings) -> None:
    """Refuse to run a worker whose jobs could be redelivered while they still run."""
    if settings.visibility_timeout <= settings.job_time_limit:
        raise ConfigurationError(
            f"ACTQ_VISIBILITY_TIMEOUT ({settings.visibility_timeout}s) must exceed ACTQ_JOB_TIME_LIMIT "
            f"({settings.job_time_limit}s): otherwise Redis redelivers a job while it is still running"
        )


def shown(record: JobRecord) -> dict[str, str]:
    """What monitors show of a job beside its id: its model, kind (`generate`, `trace`, `nnsight`),
    its run label, if any, and the start of its prompt (whitespace folded, at most
    SHOWN_PROMPT_CHARS). Never its owner (an API key's id) or anything else of the request."""
    from shared.jobs import summarize  # shared/jobs.py imports this module

    summary = summarize(record)
    prompt = " ".join(summary.prompt_preview.split())
    if len(prompt) > SHOWN_PROMPT_CHARS:
        prompt = prompt[: SHOWN_PROMPT_CHARS - 3] + "..."
    fields = {"model": record.model, "kind": summary.mode}
    if run := (record.request.metadata or {}).get(RUN_KEY):
        fields["run"] = run
    return {**fields, "prompt": prompt}  # last: the longest, cut first where a monitor's column ends


def task_message(celery: Celery, job_id: str, queue: str, show: dict[str, str] | None = None) -> str:
    """The JSON kombu's Redis transport LPUSHes onto `queue` for `run_job(job_id)` (task id = job id).
    `show` (see `shown`): what monitors show as the task's keyword arguments; the payload itself
    stays the job id alone."""
    headers, properties, body, _ = celery.amqp.create_task_message(
        job_id,
        keys.TASK_NAME,
        [job_id],
        {},
        reply_to=celery.thread_oid,
        create_sent_event=False,
        ignore_result=None,
        kwargsrepr=repr(show) if show else None,
    )
    content_type, content_encoding, data = dumps(body, serializer="json")
    return json.dumps(
        {
            "body": base64.b64encode(data.encode() if isinstance(data, str) else data).decode(),
            "content-encoding": content_encoding,
            "content-type": content_type,
            "headers": headers,
            "properties": {
                **properties,
                "delivery_mode": PERSISTENT,
                "delivery_info": {"exchange": "", "routing_key": queue},
                "priority": 0,  # kombu keeps priority-0 messages in the list named after the queue
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
    )

"""A job's broker message, written in the same Redis transaction as its record.

Celery's `send_task` would publish through kombu in a round trip of its own after the record is
written: an API process dying between the two would leave a job that is queued on paper with no
message to run it, and the publish costs about a quarter of the API's CPU per job. Instead the
API builds the message with Celery's own `create_task_message` and kombu's serializer, and the
record's MULTI pushes it onto the model's queue list exactly as kombu's Redis transport does: a
job is recorded and queued together or not at all.

The envelope is kombu's Redis transport format (kombu is pinned). tests/test_enqueue.py compares
it field by field with what `send_task` itself writes, so an upgrade that changes it fails the
build instead of stranding jobs.
"""

from __future__ import annotations

import base64
import json
import uuid

from celery import Celery
from kombu.serialization import dumps

from shared import keys

PERSISTENT = 2  # kombu's delivery_mode for durable messages


def task_message(celery: Celery, job_id: str, queue: str) -> str:
    """The JSON kombu's Redis transport LPUSHes onto `queue` for `run_job(job_id)` (task id = job id)."""
    headers, properties, body, _ = celery.amqp.create_task_message(
        job_id, keys.TASK_NAME, [job_id], {}, reply_to=celery.thread_oid, create_sent_event=False, ignore_result=None
    )
    content_type, content_encoding, data = dumps(body, serializer="json")
    return json.dumps({
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
    })  # fmt: skip


def enqueue(pipe, celery: Celery, job_id: str, model: str) -> None:
    """Add the push of `job_id`'s message onto `model`'s queue to `pipe` (the record's MULTI)."""
    queue = keys.queue(model)
    pipe.lpush(queue, task_message(celery, job_id, queue))

"""The broker message the API writes in a job's MULTI is the one Celery's send_task writes."""

from __future__ import annotations

import base64
import json

from shared import keys
from shared.broker import make_celery, task_message
from shared.settings import Settings

VOLATILE = {"origin", "delivery_tag", "reply_to"}  # per process / per message


def _strip(message: dict) -> dict:
    message = json.loads(json.dumps(message))
    for part in ("headers", "properties"):
        for name in VOLATILE:
            message[part].pop(name, None)
    return message


def test_message_matches_what_send_task_writes(redis_server, redis_client):
    celery = make_celery(Settings(redis_url=redis_server.url))
    celery.conf.task_send_sent_event = False
    queue = "actq.enqueue-conformance"
    celery.send_task(keys.TASK_NAME, args=["job-1"], task_id="job-1", queue=queue)
    theirs = json.loads(redis_client.lpop(queue))
    ours = json.loads(task_message(celery, "job-1", queue))
    assert _strip(ours) == _strip(theirs)
    assert base64.b64decode(ours["body"]) == base64.b64decode(theirs["body"])
    assert set(ours["headers"]) == set(theirs["headers"]) and set(ours["properties"]) == set(theirs["properties"])
    assert ours["headers"]["origin"] and ours["properties"]["delivery_tag"] != theirs["properties"]["delivery_tag"]

"""Hostile requests get a clear 4xx with nothing enqueued."""

from __future__ import annotations

import pytest

from shared.registry import ModelRegistry
from shared.tools import ToolFormat
from tests.support.hostile import HOSTILE, SURFACE
from tests.support.models import tiny_llama
from tests.support.stack import TINY, job_count, queued_messages


@pytest.mark.parametrize(("case", "payload", "raw", "statuses"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_a_clear_4xx_and_nothing_is_queued(http, redis_client, case, payload, raw, statuses):
    before = job_count(redis_client), queued_messages(redis_client, TINY)
    path = "/jobs/batch" if payload and "jobs" in payload else "/jobs"
    if raw is not None:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=payload)
    assert response.status_code in statuses, (case, response.status_code, response.text[:300])
    body = response.json()
    assert body["error"] and body["detail"] and "Traceback" not in response.text
    assert (job_count(redis_client), queued_messages(redis_client, TINY)) == before


@pytest.mark.parametrize(("case", "path", "payload", "statuses"), SURFACE, ids=[f"{h[0]} {h[1]}" for h in SURFACE])
def test_the_new_surface_refuses_hostile_requests_with_nothing_queued(
    http, redis_client, case, path, payload, statuses
):
    """Tools, schemas, interventions and the OpenAI routes: each hostile request gets a 4xx that
    says what to fix (in the route's own error shape), never a 500, and nothing is queued."""
    tools_model(redis_client)
    before = job_count(redis_client), queued_messages(redis_client, TINY)
    response = http.post(path, json=payload)
    assert response.status_code in statuses, (case, response.status_code, response.text[:500])
    body = response.json()
    detail = body["error"]["message"] if path.startswith("/v1") else body["detail"]
    assert detail and "Traceback" not in response.text, body
    assert (job_count(redis_client), queued_messages(redis_client, TINY)) == before


def tools_model(client) -> None:
    """`tiny` as a worker that renders tools publishes it (Hermes calls, actq's fallback prompt)."""
    registry = ModelRegistry(client, 30)
    info = tiny_llama().model_copy(update={"tool_format": ToolFormat.HERMES, "special_tokens": ["<|im_start|>"]})
    registry.publish(info)
    registry.heartbeat(info, "worker-tiny")

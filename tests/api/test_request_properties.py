"""Property tests over what the OpenAPI schema cannot describe (schemathesis covers the rest:
tests/e2e/test_fuzz.py): JSON Schemas nested, cyclic or unsatisfiable, as tools or response
formats, on every route that takes them, and edit windows written every way. Each request gets a
2xx or a 4xx (never a 5xx), and a 4xx leaves nothing queued."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.registry import ModelRegistry
from shared.tools import ToolFormat
from tests.support.hostile import CHAT
from tests.support.models import tiny_llama
from tests.support.schema_strategies import nested_schemas, windows
from tests.support.stack import TINY, job_count, queued_messages

FIXTURES = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
ROUTES = ["/jobs", "/jobs/batch", "/v1/chat/completions"]
ASCII_WINDOW = re.compile(r"(-?[0-9]{1,7})?:(-?[0-9]{1,7})?")


@pytest.fixture
def tools_model(redis_client) -> None:
    registry = ModelRegistry(redis_client, 30)
    info = tiny_llama().model_copy(update={"tool_format": ToolFormat.HERMES})
    registry.publish(info)
    registry.heartbeat(info, "worker-tiny")


def _post(http, route: str, job: dict[str, Any]):
    if route == "/jobs/batch":
        return http.post(route, json={"jobs": [{"request": job}, {"request": job}]})
    if route.startswith("/v1"):  # an accepted job is queued, and waited for briefly (no worker here)
        return http.post(route, json={**job, "actq_wait_seconds": 0.01})
    return http.post(route, json=job)


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURES)
@given(schema=nested_schemas(), as_tool=st.booleans(), forced=st.booleans(), route=st.sampled_from(ROUTES))
def test_any_schema_gets_a_2xx_or_a_4xx_and_a_4xx_queues_nothing(
    http, redis_client, tools_model, schema, as_tool, forced, route
):
    if as_tool:
        parameters = {"type": "object", "properties": {"q": schema}}
        job = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
        job |= {"tool_choice": "required"} if forced else {}
    else:
        job = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    before = job_count(redis_client), queued_messages(redis_client, TINY)
    response = _post(http, route, job)
    accepted = response.status_code in (200, 202) or (route.startswith("/v1") and response.status_code == 504)
    assert accepted or 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if not accepted:
        assert (job_count(redis_client), queued_messages(redis_client, TINY)) == before, response.text[:300]
        assert "Traceback" not in response.text


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURES)
@given(window=windows, field=st.sampled_from(["prompt", "generated"]))
def test_an_edit_window_is_ascii_digits_or_a_4xx(http, redis_client, window, field):
    edit = {"module": "model.layers.1", "op": "scale", "factor": 2.0, "positions": {field: [window]}}
    before = job_count(redis_client)
    response = http.post("/jobs", json={**CHAT, "max_tokens": 8, "interventions": [edit]})
    assert response.status_code in (202, 422), (window, response.status_code, response.text[:300])
    if response.status_code == 202:
        assert ASCII_WINDOW.fullmatch(window), window  # only what the documented grammar says is read
    else:
        assert job_count(redis_client) == before

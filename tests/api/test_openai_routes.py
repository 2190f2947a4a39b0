"""OpenAI-compatible routes as clients that keep only what OpenAI defines see them (no worker):
every /v1 path answers in OpenAI's error shape, unknown routes and wrong methods included, and
an answer about a job names it in the `x-actq-job-id` header."""

from __future__ import annotations

import pytest

from tests.support.stack import TINY, job_count


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        (
            "POST",
            "/v1/embeddings",
            404,
            "no route POST /v1/embeddings; the OpenAI-compatible routes: POST /v1/chat/completions",
        ),
        ("GET", "/v1/files/abc", 404, "no route GET /v1/files/abc"),
        ("GET", "/v1/chat/completions", 405, "GET /v1/chat/completions is not served; use POST"),
        ("DELETE", "/v1/models", 405, "DELETE /v1/models is not served; use GET"),
    ],
)
def test_unknown_routes_and_methods_answer_in_openais_shape(http, redis_client, method, path, status, message):
    before = job_count(redis_client)
    response = http.request(method, path, json={"model": TINY})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] in ("not_found", "method_not_allowed")
    assert job_count(redis_client) == before


def test_real_routes_still_answer(http):
    assert http.get("/v1/models").status_code == 200
    assert http.get(f"/v1/models/{TINY}").json()["id"] == TINY
    assert http.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"


def test_an_error_about_a_queued_job_names_it_in_a_header(http, redis_client):
    """No worker runs here: the chat completion's wait ends first, and its 504 names the queued job
    in the body and in `x-actq-job-id`."""
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "actq_wait_seconds": 0.1}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 504, response.text
    job_id = response.json()["error"]["job_id"]
    assert response.headers["x-actq-job-id"] == job_id
    assert redis_client.exists(f"actq:job:{job_id}")


def test_prompt_logprobs_past_what_a_response_holds_are_refused_before_anything_is_queued(settings, redis_client):
    """Issue 47: prompt_logprobs on a prompt over ACTQ_LOGPROBS_INLINE_TOKENS ran the whole prompt
    (about 20 s of engine time) before a 400 that counted "its 1 tokens". Now it is refused at
    submit, with the prompt's own count (token ids here: counted without a worker's tokenizer)."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from shared.registry import ModelRegistry
    from tests.support.models import tiny_llama

    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    info = tiny_llama()
    registry.publish(info)
    registry.heartbeat(info, "worker-tiny")
    ids = list(range(5, 155))  # 150 tokens: 149 entries
    body = {"model": TINY, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 1, "actq_wait_seconds": 0.1}
    limited = settings.model_copy(update={"logprobs_inline_tokens": 100})
    with TestClient(create_app(limited)) as http:
        before = job_count(redis_client)
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == "logprobs_too_long"
        assert "holds 150 tokens" in error["message"] and "149 entries" in error["message"]
        assert "ACTQ_LOGPROBS_INLINE_TOKENS=100" in error["message"]
        assert job_count(redis_client) == before
        fits = http.post("/v1/completions", json={**body, "prompt": ids[:100]})  # 99 entries: queued
        assert fits.status_code != 400 and job_count(redis_client) == before + 1, fits.text

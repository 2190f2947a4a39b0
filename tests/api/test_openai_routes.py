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

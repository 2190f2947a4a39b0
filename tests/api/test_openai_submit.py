"""One submit-and-wait flow for the OpenAI routes (api/openai/submit.py): a streamed request and
an answered one become the same jobs, with the same default capture applied once, and meet the
same refusals in the same order. Through the real app over a real Redis, with no worker."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
from fastapi.testclient import TestClient

from api import waiters
from api.main import create_app
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.support.models import tiny_llama
from tests.support.stack import TINY, job_count

DEFAULT = {"preset": "residual", "layers": [0], "positions": "generated"}


@pytest.fixture
def defaulted(settings: Settings, redis_client: redis.Redis) -> Settings:
    """`tiny` published with a live worker, and a default capture for it."""
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    info = tiny_llama()
    registry.publish(info)
    registry.heartbeat(info, "worker-tiny")
    return Settings(**{**settings.model_dump(), "default_capture_by_model": json.dumps({TINY: DEFAULT})})


def job_ids(redis_client: redis.Redis) -> set[str]:
    return {key.decode().removeprefix("actq:job:") for key in redis_client.scan_iter("actq:job:*", count=1000)}


def recorded(redis_client: redis.Redis, job_id: str) -> dict:
    raw = redis_client.get(f"actq:job:{job_id}")
    assert raw is not None, job_id
    return json.loads(raw)


def test_a_streamed_request_is_queued_as_the_answered_one_with_the_default_capture_once(defaulted, redis_client):
    """The same request, answered and streamed: jobs whose capture is the default once (one
    module, the one the default names), equal in all but `stream`, which the streamed job keeps."""
    body = {"model": TINY, "prompt": "2 + 2 =", "max_tokens": 2, "n": 2, "actq_wait_seconds": 0.1}
    jobs = {}
    with TestClient(create_app(defaulted)) as http:
        for stream in (False, True):
            before = job_ids(redis_client)
            answer = http.post("/v1/completions", json={**body, "stream": stream})
            assert answer.status_code == (200 if stream else 504), answer.text  # no worker: the waits end
            made = sorted((recorded(redis_client, i) for i in job_ids(redis_client) - before), key=lambda r: r["id"])
            assert len(made) == 2, answer.text
            jobs[stream] = sorted(made, key=lambda r: r["request"]["seed"] or 0)
    for answered, streamed in zip(jobs[False], jobs[True], strict=True):
        assert streamed["request"]["stream"] is True and answered["request"]["stream"] is False
        assert {**streamed["request"], "stream": False, "seed": None} == {**answered["request"], "seed": None}
        assert streamed["capture_points"] == answered["capture_points"]
        assert [p["module"] for p in streamed["capture_points"]] == ["model.layers.0"]
        assert streamed["request"]["capture"]["positions"] == "generated"


@pytest.mark.parametrize("stream", [False, True])
def test_at_capacity_a_streamed_request_is_refused_as_an_answered_one_before_its_capture(
    defaulted, redis_client, stream
):
    """Every long-poll place is taken: a request whose default capture does not fit it (a scoring
    job, whose positions cannot be 'generated') is a 429 with Retry-After first, streamed or not,
    as the answered flow always answered; nothing is queued. The streamed flow used to apply the
    default before taking its place (and again at submit), answering the 400 first."""
    one = Settings(**{**defaulted.model_dump(), "max_long_polls": 1})
    score = {"model": TINY, "prompt": "2 + 2 =", "max_tokens": 0, "echo": True, "stream": stream}
    with TestClient(create_app(one)) as http:
        held = http.post("/jobs", json={"model": TINY, "prompt": "hi", "max_tokens": 2}).json()["id"]
        poll = threading.Thread(target=http.get, args=(f"/jobs/{held}",), kwargs={"params": {"wait": 30}})
        poll.start()
        try:
            waiters = http.app.state.services.waiters  # type: ignore[attr-defined]
            deadline = time.monotonic() + 10
            while waiters.active < 1:
                assert time.monotonic() < deadline, "the long poll never took its place"
                time.sleep(0.01)
            before = job_count(redis_client)
            busy = http.post("/v1/completions", json=score)
            assert busy.status_code == 429, busy.text
            assert busy.headers["retry-after"] == "2" and "ACTQ_MAX_LONG_POLLS" in busy.json()["error"]["message"]
            assert job_count(redis_client) == before
        finally:
            assert http.delete(f"/jobs/{held}").status_code in (200, 202, 204)
            poll.join(30)
        assert not poll.is_alive()
        refused = http.post("/v1/completions", json=score)  # a free place: the default's own 400
        assert refused.status_code == 400, refused.text
        assert "ACTQ_DEFAULT_CAPTURE_BY_MODEL" in refused.json()["error"]["message"]
        assert job_count(redis_client) == before


def test_a_job_deleted_while_its_answered_request_waits_is_a_404_naming_it(defaulted, redis_client, monkeypatch):
    """The job's record goes (an operator's delete, an expiry, a flush) while an answered request
    waits for it: a 404 `job_not_found` that names the job and says what happened, as GET /jobs/{id}
    answers, not a 500 (it was answered 500, a server error to retry). A delete sends no event: the
    waiter sees it at its next read, every RECHECK_SECONDS (5 s shipped; 0.5 s here)."""
    monkeypatch.setattr(waiters, "RECHECK_SECONDS", 0.5)
    body = {"model": TINY, "prompt": "2 + 2 =", "max_tokens": 2, "actq_wait_seconds": 60}
    answers: list = []
    with TestClient(create_app(defaulted)) as http:
        waiting = threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
        waiting.start()
        deadline = time.monotonic() + 30
        while not (made := job_ids(redis_client)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(made) == 1, made
        (job_id,) = made
        redis_client.delete(f"actq:job:{job_id}")
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        gone = http.get(f"/jobs/{job_id}")
    (answer,) = answers
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert error["code"] == "job_not_found" and job_id in error["message"], error
    assert "deleted or expired" in error["message"], error
    assert gone.status_code == 404 and gone.json()["error"] == "job_not_found", gone.text

"""Stopping work: cancelling a running job within a decoding step, per-job time limits, and what a
client sees meanwhile (queue position, tokens so far). On SmolLM2, whose jobs last seconds."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from tests.support.stack import SMOL

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Write a long story about a cat who learns to sail."}]


def body(**changes) -> dict:
    return {
        "model": SMOL,
        "messages": STORY,
        "max_tokens": 200,
        "capture": {"modules": ["model.layers.{3,9}"], "positions": "generated"},
        **changes,
    }


def wait_until(http, job_id: str, predicate, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/jobs/{job_id}").json()
        if predicate(job):
            return job
        time.sleep(0.02)
    raise AssertionError(f"timed out; job is {job}")


def test_cancelling_a_running_job_stops_it_and_the_next_starts_at_once(live_smol):
    with live_smol.client() as http:
        long = live_smol.submit(http, body())
        following = [live_smol.submit(http, body(max_tokens=4)) for _ in range(2)]
        wait_until(http, long, lambda j: j["status"] == "running" and (j["generated_tokens"] or 0) >= 5)
        queued = http.get(f"/jobs/{following[1]}").json()
        assert queued["status"] == "queued" and queued["queue_position"] == 2  # FIFO behind following[0]
        asked = time.monotonic()
        response = http.delete(f"/jobs/{long}")
        assert response.status_code == 202 and response.json()["status"] == "running"
        job = live_smol.wait(http, long, timeout=30)
        stopped_in = time.monotonic() - asked
        assert job["status"] == "cancelled" and job["error"]["type"] == "cancelled", job
        assert job["result"]["finish_reason"] == "cancelled" and job["result"]["text"]
        assert 5 <= job["result"]["usage"]["completion_tokens"] < 200
        assert job["activations"] is None
        assert stopped_in < 2.0, stopped_in  # one decoding step is ~60 ms here; allow for polling
        nxt = live_smol.wait(http, following[0], timeout=60)
        gap = datetime.fromisoformat(nxt["started_at"]) - datetime.fromisoformat(job["finished_at"])
        assert nxt["status"] == "succeeded" and gap.total_seconds() < 1.0, gap
        assert live_smol.wait(http, following[1], timeout=60)["status"] == "succeeded"


def test_a_job_over_its_time_limit_fails_as_timeout_and_the_worker_serves_on(live_smol):
    with live_smol.client() as http:
        started = time.monotonic()
        job = live_smol.wait(http, live_smol.submit(http, body(time_limit=1.5)), timeout=60)
        assert job["status"] == "failed" and job["error"]["type"] == "timeout", job
        assert "time limit of 1.5s" in job["error"]["message"]
        assert 0 < job["result"]["usage"]["completion_tokens"] < 200 and job["result"]["finish_reason"] == "timeout"
        assert time.monotonic() - started < 30
        assert live_smol.wait(http, live_smol.submit(http, body(max_tokens=4)), timeout=60)["status"] == "succeeded"
        too_long = http.post("/jobs", json=body(time_limit=100_000))
        assert too_long.status_code == 422 and "exceeds this deployment's limit" in too_long.json()["detail"]

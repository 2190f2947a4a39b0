"""Stopping work: cancelling a running job within a decoding step, per-job time limits, and what a
client sees meanwhile (queue position, tokens so far). On SmolLM2, whose jobs last seconds."""

from __future__ import annotations

import time

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


def test_cancelling_one_running_job_of_a_batch_stops_that_row_and_the_others_go_on(live_smol):
    """Three jobs run in one batch; DELETE of one stops it within a step or so, with what it had
    generated; the other two finish all their tokens, and their results equal the same jobs run
    again on their own afterwards (greedy)."""
    with live_smol.client() as http:
        long = live_smol.submit(http, body())
        others = [live_smol.submit(http, body(max_tokens=60, capture=None)) for _ in range(2)]
        wait_until(http, long, lambda j: j["status"] == "running" and (j["generated_tokens"] or 0) >= 5)
        assert all(http.get(f"/jobs/{i}").json()["status"] == "running" for i in others), "not one batch"
        asked = time.monotonic()
        response = http.delete(f"/jobs/{long}")
        assert response.status_code == 202 and response.json()["status"] == "running"
        job = live_smol.wait(http, long, timeout=30)
        stopped_in = time.monotonic() - asked
        assert job["status"] == "cancelled" and job["error"]["type"] == "cancelled", job
        assert job["result"]["finish_reason"] == "cancelled" and job["result"]["text"]
        assert 5 <= job["result"]["usage"]["completion_tokens"] < 200
        assert job["activations"] is None
        assert stopped_in < 2.0, stopped_in  # one batched decoding step is well under 0.1 s here
        done = [live_smol.wait(http, i, timeout=60) for i in others]
        assert all(d["status"] == "succeeded" and d["result"]["usage"]["completion_tokens"] == 60 for d in done)
        again = live_smol.wait(http, live_smol.submit(http, body(max_tokens=60, capture=None)), timeout=60)
        assert all(d["result"]["text"] == again["result"]["text"] for d in done)


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

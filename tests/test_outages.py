"""Outages injected for real: Redis restarted under 200 queued jobs, the S3 server stopped in the
middle of a run, a local store whose disk fills up, a whole worker (parent and child) killed.
Each runs on a stack of its own so the session's stack never sees the fault."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from shared import keys
from shared.redis_server import RedisServer
from tests.conftest import TERMINAL, TINY, own_stack

pytestmark = pytest.mark.slow


def tiny_body(model: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": max_tokens,
            "capture": {"modules": ["model.layers.{0,3}"], "positions": "all"}, **extra}  # fmt: skip


def submit_batch(http: httpx.Client, body: dict, count: int, first: dict | None = None) -> list[str]:
    """`count` jobs of `body` in one batch; `first` replaces the first one (e.g. a longer job)."""
    entries = [{"request": first or body}] + [{"request": body}] * (count - 1)
    response = http.post("/jobs/batch", json={"jobs": entries})
    assert response.status_code == 202, response.text
    return [j["id"] for j in response.json()["jobs"]]


def wait_all(s, http: httpx.Client, ids: list[str], timeout: float) -> list[dict]:
    """Every job's final record; fails naming the jobs that never finished."""
    deadline = time.monotonic() + timeout
    pending, done = list(ids), {}
    while pending and time.monotonic() < deadline:
        job = http.get(f"/jobs/{pending[0]}", params={"wait": 5}).json()
        if job["status"] in TERMINAL:
            done[job["id"]] = job
            pending.pop(0)
    assert not pending, f"{len(pending)} jobs unfinished, e.g. {http.get(f'/jobs/{pending[0]}').json()}\n{s.log_tail('worker-w')}"
    return [done[i] for i in ids]


def wait_running(http: httpx.Client, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (status := http.get(f"/jobs/{job_id}").json()["status"]) != "running":
        assert status == "queued" and time.monotonic() < deadline, status
        time.sleep(0.005)


def assert_one_artifact_each(s, jobs: list[dict]) -> None:
    for job in jobs:
        folder = s.storage_dir / "jobs" / job["id"]
        assert sorted(p.name for p in folder.iterdir()) == ["activations.safetensors", "manifest.json"], job["id"]
        assert json.loads((folder / "manifest.json").read_text())["sha256"] == job["activations"]["sha256"]


def test_redis_restart_with_200_jobs_queued(live, tiny_dir, tmp_path):
    """Redis (append-only) stopped and started again on the same port under 200 queued jobs: the
    API answers 503 naming Redis while it is down, never 500, and recovers by itself; the worker
    reconnects by itself; every job succeeds exactly once."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=server.url) as s:
            s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-rr"})
            with s.client() as http:
                ids = submit_batch(http, tiny_body("tiny-rr", max_tokens=8), 200, first=tiny_body("tiny-rr", max_tokens=200))
                wait_running(http, ids[0])  # one job is generating when Redis goes away
                server.stop()  # SIGTERM: Redis writes its append-only file and exits
                down = {
                    "GET /jobs/{id}": http.get(f"/jobs/{ids[-1]}"),
                    "GET /jobs/{id}?wait": http.get(f"/jobs/{ids[-1]}", params={"wait": 1}),
                    "POST /jobs": http.post("/jobs", json=tiny_body("tiny-rr")),
                    "POST /jobs/batch": http.post("/jobs/batch", json={"jobs": [{"request": tiny_body("tiny-rr")}]}),
                    "GET /models": http.get("/models"),
                    "GET /health": http.get("/health"),
                }
                for what, response in down.items():
                    assert response.status_code == 503, (what, response.status_code, response.text)
                    assert "Redis" in response.json()["detail"], (what, response.text)
                time.sleep(3)
                server.start()
                deadline = time.monotonic() + 30
                while (health := http.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline, health.text
                    time.sleep(0.2)
                jobs = wait_all(s, http, ids, timeout=300)
                assert jobs[0]["attempts"] == 1 and jobs[0]["result"]["usage"]["completion_tokens"] == 200  # outcome kept
                assert [j["status"] for j in jobs] == ["succeeded"] * 200, [(j["id"], j["status"], j["error"]) for j in jobs if j["status"] != "succeeded"]
                assert_one_artifact_each(s, jobs)
                client = redis.Redis.from_url(server.url)
                assert client.zcard(keys.queued("tiny-rr")) == 0
                assert len(set(client.scan_iter(match=keys.job("*"), count=1000))) == 200  # none lost, none made twice
                client.close()
    finally:
        server.stop()

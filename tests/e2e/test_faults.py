"""Faults injected for real: a worker's pool child killed with SIGKILL mid-generation, and a model
with no worker at all. Every job still ends succeeded exactly once; nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from shared.registry import ModelRegistry
from shared.schemas import ModelInfo
from tests.support.stack import TINY

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def test_kill_9_of_the_generating_process_loses_no_job(live, tiny_dir):
    worker = live.start_worker("tiny-crash", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-crash"})
    body = {
        "model": "tiny-crash",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 150,
        "capture": {"modules": ["model.layers.{0,3}"], "positions": "generated"},
    }
    kills = 0
    with live.client() as http:
        ids = [live.submit(http, body) for _ in range(20)]
        deadline = time.monotonic() + 300
        for target in ids[2:14:4]:  # kill three times, each while a job is generating
            while http.get(f"/jobs/{target}").json()["status"] != "running":
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.2)
            pool = children(worker.pid)
            assert pool, "no pool child to kill"
            for pid in pool:
                os.kill(pid, signal.SIGKILL)
            kills += 1
        jobs = [live.wait(http, job_id, timeout=300) for job_id in ids]
    assert kills == 3
    assert all(j["status"] == "succeeded" for j in jobs), [
        (j["id"], j["status"], j["error"]) for j in jobs if j["status"] != "succeeded"
    ]
    hit = [j for j in jobs if j["attempts"] >= 2]
    assert len(hit) >= 3, [j["attempts"] for j in jobs]
    for job in jobs:  # one file and one manifest each; no temp file left anywhere
        folder = live.storage_dir / "jobs" / job["id"]
        assert sorted(p.name for p in folder.iterdir()) == ["activations.safetensors", "manifest.json"]
        assert json.loads((folder / "manifest.json").read_text())["sha256"] == job["activations"]["sha256"]


def test_jobs_for_a_model_with_no_worker_wait_and_run_when_one_comes(live, tiny_dir, redis_client):
    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    info = registry.get(TINY)
    registry.publish(ModelInfo.model_validate({**info.model_dump(), "name": "tiny-late"}))  # known, never served yet
    body = {"model": "tiny-late", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with live.client() as http:
        ids = [live.submit(http, body) for _ in range(3)]
        time.sleep(1.0)
        waiting = [http.get(f"/jobs/{i}").json() for i in ids]
        assert [j["status"] for j in waiting] == ["queued"] * 3 and [j["queue_position"] for j in waiting] == [1, 2, 3]
        assert http.get("/health").json()["queued"]["tiny-late"] == 3
        live.start_worker("tiny-late", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-late"})
        assert all(live.wait(http, i, timeout=120)["status"] == "succeeded" for i in ids)

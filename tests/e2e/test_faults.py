"""Faults injected for real: a worker's engine process killed with SIGKILL mid-batch, and a model
with no worker at all. Every job still ends succeeded exactly once; nothing is lost."""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest

from shared.registry import ModelRegistry
from shared.schemas import ModelInfo
from tests.support.stack import TINY, assert_stored_once

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


def running_since(http, ids: list[str], since: float) -> list[str]:
    """Jobs running in a batch that started after `since` (a killed engine's jobs still read
    `running` until they are claimed again)."""
    found = []
    for job_id in ids:
        job = http.get(f"/jobs/{job_id}").json()
        if job["status"] == "running" and datetime.fromisoformat(job["started_at"]).timestamp() > since:
            if (job["generated_tokens"] or 0) >= 3:
                found.append(job_id)
    return found


def test_kill_9_of_the_engine_mid_batch_redelivers_every_job_of_the_batch(live, tiny_dir):
    """A worker running batches of 8: its engine process is SIGKILLed while a full batch
    generates, twice (the second time in a later batch). Every job of each batch goes back to the
    queue at once, the worker starts a new engine, and every one of the 24 jobs ends succeeded
    exactly once, with one file and one manifest; the killed batches' jobs have attempts >= 2."""
    worker = live.start_worker(
        "tiny-crash", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-crash", "ACTQ_MAX_BATCH": "8"}
    )
    body = {
        "model": "tiny-crash",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 150,
        "capture": {"modules": ["model.layers.{0,3}"], "positions": "generated"},
    }
    killed: list[set[str]] = []
    with live.client() as http:
        ids = [live.submit(http, body) for _ in range(24)]
        deadline, since = time.monotonic() + 300, 0.0
        for _ in range(2):
            while len(batch := running_since(http, ids, since)) < 8:
                assert time.monotonic() < deadline, batch
                time.sleep(0.02)
            engines = children(worker.pid)
            assert len(engines) == 1, f"expected one engine process, found {engines}"
            os.kill(engines[0], signal.SIGKILL)
            since = time.time()
            killed.append(set(batch))
        jobs = [live.wait(http, job_id, timeout=300) for job_id in ids]
    assert all(len(batch) == 8 for batch in killed), killed
    assert all(j["status"] == "succeeded" for j in jobs), [
        (j["id"], j["status"], j["error"]) for j in jobs if j["status"] != "succeeded"
    ]
    for job in jobs:
        hits = sum(job["id"] in batch for batch in killed)
        assert job["attempts"] == 1 + hits, (job["id"], job["attempts"], hits)
    for job in jobs:  # one file and one manifest each, in the last attempt's folder; no temp file left anywhere
        assert_stored_once(live.storage_dir, job)
    assert worker.poll() is None, "the worker itself stays up"
    live.stop_process("worker-tiny-crash")  # the shared stack's later tests do not need it


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
    live.stop_process("worker-tiny-late")  # the shared stack's later tests do not need it


FAULT = Path(__file__).resolve().parent.parent / "support" / "engine_fault"


def test_an_exception_that_escapes_the_engine_thread_restarts_the_engine_and_its_jobs_run_again(
    live, tiny_dir, tmp_path, redis_client
):
    """A bug outside every guarded call of the engine thread (injected in the first engine process
    only, tests/support/engine_fault): the engine process logs the reason and exits, every job of
    its batch goes back to the queue as after kill -9, a new engine serves them, and every job
    ends succeeded exactly once with its own file; the dead engine is no longer listed live."""
    marker = tmp_path / "engine-fault"
    env = {
        "ACTQ_MODEL": str(tiny_dir),
        "ACTQ_MODEL_NAME": "tiny-watch",
        "ACTQ_MAX_BATCH": "4",
        "PYTHONPATH": str(FAULT),
        "ENGINE_FAULT_ONCE": str(marker),
    }
    worker = live.start_worker("tiny-watch", env)
    try:
        body = {
            "model": "tiny-watch",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 40,
            "capture": {"modules": ["model.layers.{0,3}"], "positions": "generated"},
        }
        with live.client() as http:
            ids = [live.submit(http, body) for _ in range(4)]
            jobs = [live.wait(http, job_id, timeout=300) for job_id in ids]
        assert marker.exists(), "the fault was never armed"
        assert all(j["status"] == "succeeded" for j in jobs), [(j["id"], j["status"], j["error"]) for j in jobs]
        assert any(j["attempts"] == 2 for j in jobs), [j["attempts"] for j in jobs]  # the batch that died ran again
        assert all(j["attempts"] <= 2 for j in jobs)
        for job in jobs:
            assert_stored_once(live.storage_dir, job)
        log = live.log_tail("worker-tiny-watch", 1_000_000)
        assert "the engine thread died (RuntimeError: injected: a bug outside every guarded call)" in log
        served = re.findall(r"serving tiny-watch \(.*\) as (\S+)", log)
        assert len(served) == 2, served  # a second engine process took over, under the worker's node name
        assert served[0] == served[1] == jobs[0]["worker"], (served, jobs[0]["worker"])
        live_ids = ModelRegistry(redis_client, heartbeat_ttl=60).live_workers("tiny-watch")
        assert live_ids == [served[1]], (served, live_ids)  # listed once: the dead engine left no entry of its own
        assert worker.poll() is None, "the worker itself stays up"
    finally:  # a failure here must not leave a dead worker for the stack's later tests
        live.stop_process("worker-tiny-watch")

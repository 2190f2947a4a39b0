"""An engine process that dies says why (`{"dead": reason}` to its worker, worker/engine/process.py),
and the reason reaches the worker's log and the error of each job it held on its last attempt;
and the Celery process in front of the engine never loads torch, whatever it has run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shared.cli.local_stack import worker_command
from tests.e2e.test_faults import FAULT, children

pytestmark = pytest.mark.slow

INJECTED = "RuntimeError: injected: a bug outside every guarded call"  # tests/support/engine_fault


def test_the_reason_an_engine_died_reaches_each_of_its_jobs_error_and_the_worker_log(live, tiny_dir, tmp_path):
    """The first engine process's thread raises with a batch of 4 running (tests/support/engine_fault);
    with ACTQ_MAX_ATTEMPTS=1 every job of that batch fails as `worker_lost`, and its error names the
    exception the engine process reported before it ended, as does the Celery worker's own line."""
    marker = tmp_path / "engine-fault"
    env = {
        "ACTQ_MODEL": str(tiny_dir),
        "ACTQ_MODEL_NAME": "tiny-dead",
        "ACTQ_MAX_BATCH": "4",
        "ACTQ_MAX_ATTEMPTS": "1",
        "PYTHONPATH": str(FAULT),
        "ENGINE_FAULT_ONCE": str(marker),
    }
    worker = live.start_worker("tiny-dead", env)
    try:
        body = {
            "model": "tiny-dead",
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 40,
        }
        with live.client() as http:
            ids = [live.submit(http, body) for _ in range(4)]
            jobs = [live.wait(http, job_id, timeout=300) for job_id in ids]
        assert marker.exists(), "the fault was never armed"
        lost = [job for job in jobs if job["status"] == "failed"]
        assert lost, [(j["status"], j["attempts"]) for j in jobs]  # the batch the fault hit
        for job in lost:
            assert job["error"]["type"] == "worker_lost", job["error"]
            assert f"exit status 70: {INJECTED}" in job["error"]["message"], job["error"]
        assert all(j["status"] == "succeeded" for j in jobs if j not in lost), [j["status"] for j in jobs]
        log = live.log_tail("worker-tiny-dead", 1_000_000)
        told = f"(exit status 70: {INJECTED})"
        said = [line for line in log.splitlines() if "/MainProcess]" in line and told in line]
        assert said, log[-3000:]  # the Celery process's own line (not the engine's), with the reason it was told
        assert worker.poll() is None, "the worker itself stays up"
    finally:  # a failure here must not leave a dead worker for the stack's later tests
        live.stop_process("worker-tiny-dead")


def test_a_worker_whose_engine_cannot_load_its_model_says_why_in_its_own_line(tmp_path):
    """An engine process that cannot load its model (an empty folder) says why before it exits 1;
    the Celery process's own failure (exit 1) carries that reason, not only the exit status."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACTQ_MODEL": str(tmp_path), "ACTQ_REDIS_URL": "redis://127.0.0.1:1/0"}
    done = subprocess.run(worker_command(), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("worker.engine_client.EngineStartFailed:")]
    assert len(said) == 1, done.stderr[-3000:]
    assert f"the capture engine process ended (exit status 1: cannot serve model {tmp_path}: " in said[0], said


def mapped_torch(pid: int) -> list[str]:
    """The files of torch's package that process `pid` has mapped (its shared libraries, once imported)."""
    with open(f"/proc/{pid}/maps") as handle:
        return sorted({line.split()[-1] for line in handle if f"{os.sep}torch{os.sep}" in line.split()[-1]})


def test_the_celery_process_never_loads_torch(live, tiny_dir):
    """A real worker, after its start (worker_init, worker_ready) and a job run through its task:
    its Celery process has none of torch's libraries mapped, while its engine process has (the
    check sees torch where it is loaded)."""
    worker = live.start_worker("tiny-light", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-light"})
    try:
        body = {"model": "tiny-light", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        with live.client() as http:
            assert live.wait(http, live.submit(http, body))["status"] == "succeeded"
        engines = children(worker.pid)
        assert len(engines) == 1, engines
        assert any(Path(p).name.startswith("libtorch") for p in mapped_torch(engines[0])), "the check sees torch"
        assert mapped_torch(worker.pid) == [], "the Celery process loaded torch"
    finally:
        live.stop_process("worker-tiny-light")

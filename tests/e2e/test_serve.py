"""`actq serve` as a user runs it: in the foreground, a job through it, Ctrl-C (SIGINT), nothing
left running, and the next start on the same data directory still has the finished job and its file."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shared.cli.processes import free_port

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def start(data: Path, model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTQ_")}
    env["ACTQ_REDIS_URL"] = "redis://127.0.0.1:1/0"  # someone else's Redis: serve must not use it
    cmd = [sys.executable, "-m", "shared.cli", "serve", "--port", str(port), "--data-dir", str(data)]
    with open(log, "ab") as out:
        return subprocess.Popen([*cmd, "--model", str(model)], env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_serving(base: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    """Until serve says it is serving (a second start finds the first one's line too: it is the
    same log, so the line is looked for with this start's port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        if f"actq is serving tiny at {base}" in log.read_text():  # what a user waits for
            assert httpx.get(f"{base}/health", timeout=2).json()["workers"]["tiny"] > 0
            return
        time.sleep(0.25)
    raise AssertionError(f"actq serve did not come up:\n{log.read_text()[-3000:]}")


def interrupt(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT) -> list[int]:
    """SIGINT, as Ctrl-C sends it (or `sig`); returns the children it had (each leads a process group)."""
    children = [
        int(p) for p in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    ]
    assert len(children) == 3  # redis-server, uvicorn, the celery worker
    process.send_signal(sig)
    assert process.wait(90) == 0
    return children


def gone(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_runs_a_job_stops_on_ctrl_c_and_keeps_it(tiny_dir, tmp_path):
    data, log = tmp_path / "data", tmp_path / "serve.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = start(data, tiny_dir, port, log)
    try:
        wait_serving(base, process, log)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "capture": {"modules": ["model.layers.1"]}}
        job_id = httpx.post(f"{base}/jobs", json=body).json()["id"]
        job = httpx.get(f"{base}/jobs/{job_id}", params={"wait": 60}, timeout=90).json()
        assert job["status"] == "succeeded", job
        file = httpx.get(f"{base}/jobs/{job_id}/activations").content
        assert hashlib.sha256(file).hexdigest() == job["activations"]["sha256"]
        assert (data / "store").is_dir() and job["activations"]["uri"].startswith((data / "store").as_uri())
    finally:
        children = interrupt(process) if process.poll() is None else []
    text = log.read_text()
    assert "ignoring ACTQ_REDIS_URL=redis://127.0.0.1:1/0" in text
    assert f"actq is serving tiny at http://127.0.0.1:{port}" in text
    assert f"job {job_id} succeeded" in text  # the worker's one INFO line per job, on the terminal
    assert "stopped: worker, API and Redis" in text
    assert "restarting it" not in text  # no engine is restarted while the worker stops
    assert all(gone(child) for child in children)  # nothing left running, pool children included

    port = free_port()  # the next start on the same data directory
    base = f"http://127.0.0.1:{port}"
    process = start(data, tiny_dir, port, log)
    try:
        wait_serving(base, process, log)
        again = httpx.get(f"{base}/jobs/{job_id}").json()
        assert again["status"] == "succeeded" and again["result"] == job["result"]
        assert httpx.get(f"{base}/jobs/{job_id}/activations").content == file
    finally:
        if process.poll() is None:
            interrupt(process, signal.SIGTERM)  # `kill`, as a service manager stops it: the same clean stop


def test_serve_refuses_a_port_that_is_taken(tmp_path):
    port = free_port()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        done = subprocess.run(
            [sys.executable, "-m", "shared.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2 and f"port {port} on 127.0.0.1 is taken" in done.stderr

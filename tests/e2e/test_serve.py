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
import redis

from shared.cli.processes import free_port
from tests.support.tmpfs import mounted_tmpfs

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def start(data: Path, model: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTQ_")}
    env["ACTQ_REDIS_URL"] = "redis://127.0.0.1:1/0"  # someone else's Redis: serve must not use it
    cmd = [sys.executable, "-m", "shared.cli", "serve", "--port", str(port), "--data-dir", str(data)]
    # as a script or CI starts it in the background: SIGINT arrives ignored, and Ctrl-C must still stop it
    shell = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd, "--model", str(model)]
    with open(log, "ab") as out:
        return subprocess.Popen(shell, env=env, stdout=out, stderr=subprocess.STDOUT)


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


def child(process: subprocess.Popen[bytes], word: str) -> int:
    """The pid of serve's child whose command line has `word` (redis-server, celery, uvicorn)."""
    found = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    named = [int(p) for p in found if word in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert len(named) == 1, (word, found)
    return named[0]


def wait_for(log: Path, text: str, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def run_job(base: str) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "capture": {"modules": ["model.layers.1"]}}
    response = httpx.post(f"{base}/jobs", json=body, timeout=10)
    assert response.status_code == 202, response.text
    deadline = time.monotonic() + 90
    while True:  # plain reads: the long-poll path is not what this checks
        job = httpx.get(f"{base}/jobs/{response.json()['id']}", timeout=10).json()
        if job["status"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert job["status"] == "succeeded", job
    return job


def test_serve_starts_its_redis_and_worker_again_after_kill_9(tiny_dir, tmp_path):
    """kill -9 of serve's Redis: serve says so and starts it again on the same port with the same
    data (appendfsync always: the finished job is still there), and the stack works again; the
    same for the worker (parent and engine process)."""
    data, log = tmp_path / "data", tmp_path / "serve.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = start(data, tiny_dir, port, log)
    try:
        wait_serving(base, process, log)
        before = run_job(base)
        redis_pid = child(process, "redis-server")
        redis_port = log.read_text().split("Redis: redis://127.0.0.1:")[1].split("/")[0]
        client = redis.Redis(port=int(redis_port))
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        client.close()
        os.kill(redis_pid, signal.SIGKILL)
        wait_for(log, "Redis exited with code -9", process)
        wait_for(log, "starting it again (1 of 3", process)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        again = Path(f"/proc/{child(process, 'redis-server')}/cmdline").read_bytes()  # its title: host:port
        assert f"127.0.0.1:{redis_port}".encode() in again  # the same port
        assert httpx.get(f"{base}/jobs/{before['id']}").json()["status"] == "succeeded"  # kept on disk
        run_job(base)

        os.killpg(child(process, "celery"), signal.SIGKILL)
        wait_for(log, "worker-serve exited with code -9", process)
        wait_for(log, "worker-serve is back", process, timeout=180)
        run_job(base)
    finally:
        if process.poll() is None:
            interrupt(process)
    assert "stopped: worker, API and Redis" in log.read_text()


def test_a_full_disk_under_serves_redis_loses_no_accepted_job(tiny_dir, tmp_path):
    """The data directory on a small tmpfs, filled up (issue 22): Redis cannot write its
    append-only file. Every POST /jobs is answered 202 (on disk: appendfsync always) or 503,
    never 500; Redis exits instead of acknowledging what it could not keep, serve starts it again
    a few times and then stops everything with the reason. With room again, the next serve on the
    same data directory finds every 202'd job and runs it."""
    log = tmp_path / "serve.log"
    with mounted_tmpfs(tmp_path / "full", "48m") as mount:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = start(mount / "data", tiny_dir, port, log)
        try:
            wait_serving(base, process, log)
            assert "share one filesystem" in log.read_text()  # the store is under the data dir too
            accepted = [run_job(base)["id"]]
            filler = mount / "filler"
            with open(filler, "wb", buffering=0) as handle:  # unbuffered: closing it writes nothing
                try:
                    while True:
                        handle.write(b"\0" * (1 << 20))
                except OSError:
                    pass
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
            answers: list[int] = []
            deadline = time.monotonic() + 120
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    response = httpx.post(f"{base}/jobs", json=body, timeout=10)
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                answers.append(response.status_code)
                if response.status_code == 202:
                    accepted.append(response.json()["id"])
                time.sleep(0.05)
            assert process.wait(60) == 2, log.read_text()[-3000:]
        finally:
            if process.poll() is None:
                interrupt(process)
        text = log.read_text()
        assert set(answers) <= {202, 503} and 503 in answers, answers
        assert "Redis exited with code 1" in text and "stopping the rest" in text, text[-3000:]
        filler.unlink()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = start(mount / "data", tiny_dir, port, log)
        try:
            wait_serving(base, process, log)
            for job_id in accepted:
                job = httpx.get(f"{base}/jobs/{job_id}", params={"wait": 60}, timeout=90)
                assert job.status_code == 200 and job.json()["status"] == "succeeded", (job_id, job.text)
        finally:
            if process.poll() is None:
                interrupt(process)

"""Flower on the test broker: a job shows as succeeded through Flower's API (with basic auth), its
arguments are the job id only, and the tasks page lists it in headless Chromium."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import httpx
import pytest

from shared.cli.processes import free_port, spawn, stop
from tests.support.stack import TINY

AUTH = ("flower-admin", "flower-secret-1")


@pytest.fixture(scope="module")
def flower(live, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("flower") / "flower.log"
    env = {**live.env, "ACTQ_FLOWER_BASIC_AUTH": ":".join(AUTH)}
    cmd = [sys.executable, "-m", "shared.cli", "flower", "--port", str(port), "--address", "127.0.0.1"]
    process = spawn(cmd, log, env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{base}/healthcheck", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            time.sleep(0.2)
    time.sleep(1.0)  # let Flower subscribe to the event stream before the job runs
    yield base
    stop(process)


def test_flower_needs_its_password_and_shows_the_job(flower, live, http):
    assert httpx.get(f"{flower}/api/tasks", timeout=10).status_code == 401
    assert httpx.get(f"{flower}/api/tasks", auth=("flower-admin", "wrong"), timeout=10).status_code == 401
    secret = "a request body Flower must never show"
    job = live.wait(
        http, live.submit(http, {"model": TINY, "messages": [{"role": "user", "content": secret}], "max_tokens": 3})
    )
    deadline = time.monotonic() + 30
    while True:
        tasks = httpx.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json()
        task = tasks.get(job["id"])
        if task and task.get("state") == "SUCCESS":
            break
        assert time.monotonic() < deadline, tasks
        time.sleep(0.3)
    assert task["name"] == "actq.run_job"
    assert task["args"] == f"['{job['id']}']"  # the job id, never the request body
    assert secret not in str(tasks)


def test_the_tasks_page_lists_the_job_in_headless_chromium(flower, live, http, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make test installs it when it can: apt-get install chromium)")
    job = live.wait(
        http, live.submit(http, {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    )
    url = f"http://{AUTH[0]}:{AUTH[1]}@{flower.removeprefix('http://')}/tasks"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=8000",
        "--window-size=1400,900",
    ]
    shot = tmp_path / "flower-tasks.png"
    deadline = time.monotonic() + 60
    while True:
        dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        if job["id"] in dom:
            break
        assert time.monotonic() < deadline, dom[-2000:]
        time.sleep(1)
    subprocess.run([browser, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert "actq.run_job" in dom

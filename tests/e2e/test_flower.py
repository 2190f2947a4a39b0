"""Flower on the test broker: a job shows as succeeded through Flower's API (with basic auth), its
argument is the job id and its keyword arguments only what identifies it (model, kind, the start
of its prompt, its run label); a failed job shows as FAILURE and a cancelled one as REVOKED,
Flower's counters agree with /metrics, and the tasks page shows all of it in headless Chromium."""

from __future__ import annotations

import ast
import html
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from shared.cli.processes import free_port, spawn, stop
from tests.support.browser import chromium, flags
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


def flower_task(flower: str, job_id: str, state: str, timeout: float = 30) -> dict:
    """The job's task as Flower's API shows it, once it is in `state`."""
    deadline = time.monotonic() + timeout
    while True:
        tasks = httpx.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json()
        task = tasks.get(job_id)
        if task and task.get("state") == state:
            return task
        assert time.monotonic() < deadline, (state, task)
        time.sleep(0.3)


def flower_counts(flower: str) -> Counter[str]:
    """Flower's per-worker event counters (its workers page: Failed, Succeeded...), summed."""
    rows = httpx.get(f"{flower}/workers", params={"json": 1}, auth=AUTH, timeout=10).json()["data"]
    return sum((Counter({k: v for k, v in row.items() if k.startswith("task-")}) for row in rows), Counter())


def outcomes(http) -> dict[str, float]:
    """/metrics' job counters of the tiny model, by outcome."""
    found = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f'actq_jobs_total{{model="{TINY}",outcome="'):
            name, _, value = line.rpartition(" ")
            found[name.split('outcome="')[1].rstrip('"}')] = float(value)
    return found


def test_flower_needs_its_password_and_shows_the_job(flower, live, http):
    assert httpx.get(f"{flower}/api/tasks", timeout=10).status_code == 401
    assert httpx.get(f"{flower}/api/tasks", auth=("flower-admin", "wrong"), timeout=10).status_code == 401
    secret = "the rest of the prompt Flower must never show"
    prompt = "What is 2+3?\n  Answer   with one number, please, and nothing else at all. " + secret
    body = {"model": TINY, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3}
    job = live.wait(http, live.submit(http, {**body, "metadata": {"run": "flower-run-1"}}))
    task = flower_task(flower, job["id"], "SUCCESS")
    assert task["name"] == "actq.run_job"
    assert task["args"] == f"['{job['id']}']"  # the payload: the job id alone
    shown = ast.literal_eval(task["kwargs"])  # what identifies the job, never the request
    assert shown == {
        "model": TINY,
        "kind": "generate",
        "prompt": "What is 2+3? Answer with one number, please, and nothing ...",
        "run": "flower-run-1",
    }
    assert secret not in str(httpx.get(f"{flower}/api/tasks", auth=AUTH, timeout=10).json())
    assert task["worker"] == job["worker"]  # GET /jobs/{id} names the worker as Flower does


def test_a_failed_and_a_cancelled_job_show_as_such_and_flower_counts_agree_with_metrics(flower, live, http):
    flower_before, metrics_before = flower_counts(flower), outcomes(http)
    too_long = [{"role": "user", "content": "word " * 400}]  # past the tiny model's 256-token context
    failed = live.wait(http, live.submit(http, {"model": TINY, "messages": too_long, "max_tokens": 4}))
    assert failed["status"] == "failed" and failed["error"]["type"] == "context_length_exceeded"
    long = live.submit(http, {"model": TINY, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 200})
    assert http.delete(f"/jobs/{long}").status_code in (200, 202)  # queued (200) or running (202): cancelled
    cancelled = live.wait(http, long)
    assert cancelled["status"] == "cancelled", cancelled
    task = flower_task(flower, failed["id"], "FAILURE")
    assert "context_length_exceeded" in task["exception"] and "maximum context length is 256" in task["exception"]
    flower_task(flower, cancelled["id"], "REVOKED")
    deadline = time.monotonic() + 10
    while True:  # Flower counts the events as they arrive
        flower_after, metrics_after = flower_counts(flower), outcomes(http)
        seen = {
            "failed": flower_after["task-failed"] - flower_before["task-failed"],
            "cancelled": flower_after["task-revoked"] - flower_before["task-revoked"],
            "succeeded": flower_after["task-succeeded"] - flower_before["task-succeeded"],
        }
        if seen == {"failed": 1, "cancelled": 1, "succeeded": 0} or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    counted = {k: metrics_after.get(k, 0) - metrics_before.get(k, 0) for k in ("failed", "cancelled", "succeeded")}
    assert seen == counted == {"failed": 1, "cancelled": 1, "succeeded": 0}, (seen, counted)


def test_the_tasks_page_shows_each_outcome_in_headless_chromium(flower, live, http, tmp_path):
    browser = chromium()
    run = {"metadata": {"run": "chromium-run"}}
    job = live.wait(
        http,
        live.submit(http, {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **run}),
    )
    too_long = [{"role": "user", "content": "word " * 400}]
    failed = live.wait(http, live.submit(http, {"model": TINY, "messages": too_long, "max_tokens": 4, **run}))
    long = live.submit(http, {"model": TINY, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 200})
    assert http.delete(f"/jobs/{long}").status_code in (200, 202)
    assert live.wait(http, long)["status"] == "cancelled"
    flower_task(flower, long, "REVOKED")
    url = f"http://{AUTH[0]}:{AUTH[1]}@{flower.removeprefix('http://')}/tasks"
    options = flags(str(tmp_path / "profile"), 8)
    shot = tmp_path / "flower-tasks.png"
    deadline = time.monotonic() + 60
    while True:
        dom = subprocess.run([browser, *options, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        if all(i in dom for i in (job["id"], failed["id"], long)):
            break
        assert time.monotonic() < deadline, dom[-2000:]
        time.sleep(1)
    subprocess.run([browser, *options, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert "actq.run_job" in dom
    rows = {i: row_of(dom, i) for i in (job["id"], failed["id"], long)}
    assert "SUCCESS" in rows[job["id"]] and "chromium-run" in rows[job["id"]] and "'prompt': 'hi'" in rows[job["id"]]
    assert "FAILURE" in rows[failed["id"]] and "chromium-run" in rows[failed["id"]]
    assert "context_length_exceeded" in rows[failed["id"]]  # its exception: the job's error
    assert "REVOKED" in rows[long] and "'prompt': 'Count.'" in rows[long] and f"'model': '{TINY}'" in rows[long]


def row_of(dom: str, job_id: str) -> str:
    """The text of the tasks table's row that holds `job_id` (its cells, tags stripped)."""
    import re

    for row in re.findall(r"<tr\b.*?</tr>", dom, flags=re.S):
        if job_id in row:
            return html.unescape(re.sub(r"<[^>]+>", " ", row))
    raise AssertionError(f"no row for {job_id}")

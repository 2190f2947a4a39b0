"""The bulk commands as operators run them, with faults injected for real (issue 47): Redis
restarted under a running `actq gsm8k`, the S3 server stopped while `--download` fetches and
while `actq export` fetches, and Ctrl-C in the middle of a run, whose jobs `actq cancel` then
cancels. Each outage runs on a stack of its own; the Ctrl-C test uses a worker of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from tests.e2e.conftest import own_stack
from tests.support.stack import TERMINAL

pytestmark = pytest.mark.slow


def actq(base_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", *args, "--api", base_url]


def run_env(stack) -> dict:
    return {**os.environ, **stack.env}


def wait_for(path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline and process.poll() is None, (
            process.communicate()[1] if process.poll() is not None else f"no {path}"
        )
        time.sleep(0.05)


def wait_ended(http, job_ids, timeout: float = 120) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    ended: dict[str, dict] = {}
    for job_id in job_ids:
        while (job := http.get(f"/jobs/{job_id}", params={"wait": 2}).json())["status"] not in TERMINAL:
            assert time.monotonic() < deadline, job
        ended[job_id] = job
    return ended


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_gsm8k_waits_out_a_3_s_redis_restart(live, tiny_dir, tmp_path, own_redis):
    """Redis stopped for 3 s while every problem of a run is queued (the worker paused, so the
    command surely polls during the outage): the API answers 503 naming Redis, the command says
    each retry and finishes the run, exit 0 (it exited 2 at the first 503)."""
    model = "tiny-cli-rr"
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url) as s:
        worker = s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": model}).pid
        s.wait_workers()
        out = tmp_path / "run"
        args = ["gsm8k", "--out", str(out), "--dataset", "samples", "--model", model, "--max-tokens", "16", "--quiet"]
        process = subprocess.Popen(
            actq(s.base_url, *args), env=run_env(s), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        os.killpg(worker, signal.SIGSTOP)
        try:
            wait_for(out / "jobs.json", process)
            own_redis.stop()
            time.sleep(3)
            own_redis.start()
        finally:
            os.killpg(worker, signal.SIGCONT)
        stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "503 service_unavailable: Redis (the job store and broker) cannot be reached" in stderr, stderr
    assert "retrying for up to 60 s, --retry-timeout" in stderr and "stamina.retry_scheduled" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["succeeded"] == summary["problems"] == 12, summary


def test_ctrl_c_says_what_is_left_and_actq_cancel_cancels_it(live, tiny_dir, tmp_path):
    """Ctrl-C once some problems have finished and the rest wait (the worker paused): the command
    says how many of the run's jobs are still queued or running, with the run label and the
    `actq cancel` command. That command, run as printed, cancels exactly those (the API then
    says `cancelled` for each, the worker never runs them) and counts those already finished."""
    model = "tiny-cli-cancel"
    worker = live.start_worker(model, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": model, "ACTQ_MAX_BATCH": "4"})
    out = tmp_path / "run"
    args = ["gsm8k", "--out", str(out), "--dataset", "samples", "--model", model, "--max-tokens", "120", "--quiet"]
    os.killpg(worker.pid, signal.SIGSTOP)
    try:
        process = subprocess.Popen(
            actq(live.base_url, *args), env=run_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        wait_for(out / "jobs.json", process)
        os.killpg(worker.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not (out / "samples").exists() or not list((out / "samples").glob("*.json")):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.01)
        os.killpg(worker.pid, signal.SIGSTOP)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130 and "run the same command to resume" in stderr, stderr
        ids = list(json.loads((out / "jobs.json").read_text()).values())
        with live.client() as http:
            before = {i: http.get(f"/jobs/{i}").json()["status"] for i in ids}
            unfinished = [i for i, status in before.items() if status not in TERMINAL]
            finished = len(ids) - len(unfinished)
            assert unfinished and finished, before
            said = re.search(r"(\d+) jobs of run (\S+) are still on the queue \((\d+) queued, (\d+) running\)", stderr)
            assert said is not None, stderr
            assert int(said[1]) == len(unfinished) and said[2].startswith("gsm8k-")
            assert int(said[3]) == sum(before[i] == "queued" for i in unfinished)
            printed = re.search(r"to cancel them: (actq cancel .*)$", stderr, re.MULTILINE)
            assert printed is not None and printed[1] == f"actq cancel --run {said[2]} --api {live.base_url}", stderr
            cancel = printed[1].split()[1:]
            done = subprocess.run(
                [sys.executable, "-m", "shared.cli", *cancel], env=run_env(live), capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr
            assert f"run {said[2]}: cancelled {len(unfinished)} jobs (" in done.stdout, done.stdout
            assert f"{finished} had already finished ({finished} succeeded)" in done.stdout, done.stdout
            listed = http.get("/jobs", params={"metadata.run": said[2], "limit": 100}).json()
            assert sorted(j["id"] for j in listed) == sorted(ids)  # the label is on every job of the run
            os.killpg(worker.pid, signal.SIGCONT)
            after = wait_ended(http, ids, timeout=60)
        assert all(after[i]["status"] == "cancelled" for i in unfinished), [after[i]["status"] for i in unfinished]
        assert all(after[i]["status"] == before[i] == "succeeded" for i in ids if i not in unfinished)
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
        live.stop_process(f"worker-{model}")


@pytest.fixture(scope="module")
def s3_stack(live, tiny_dir, tmp_path_factory):
    """SeaweedFS, an API and a tiny-model worker storing activations in it, for this module."""
    from tests.support.s3_server import SeaweedS3

    root = tmp_path_factory.mktemp("cli-s3")
    s3 = SeaweedS3(root / "seaweedfs").start()
    try:
        with own_stack(root / "stack", live.env, **s3.env("cli")) as s:
            s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": S3_MODEL})
            s.wait_workers()
            yield s3, s
    finally:
        s3.stop()


S3_MODEL = "tiny-cli-s3"
GSM8K_DOWNLOAD = ["gsm8k", "--dataset", "samples", "--model", S3_MODEL, "--max-tokens", "8", "--download", "--quiet"]


def test_s3_down_during_download_names_the_store_and_the_same_command_finishes_after(s3_stack, tmp_path):
    """SeaweedFS stopped while `actq gsm8k --download` downloads: the error names the object store's
    URL and says the API answered (it said "cannot reach the actq API"); the same command once S3
    is back finishes the run."""
    s3, s = s3_stack
    out = tmp_path / "run"
    args = [*GSM8K_DOWNLOAD, "--out", str(out)]
    process = subprocess.Popen(
        actq(s.base_url, *args, "--retry-timeout", "3"),
        env=run_env(s),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(out / "jobs.json", process)
    process.send_signal(signal.SIGSTOP)  # it downloads once the jobs have ended, and S3 is down
    try:
        with s.client() as http:
            jobs = json.loads((out / "jobs.json").read_text())
            assert all(j["status"] == "succeeded" for j in wait_ended(http, jobs.values()).values())
        s3.stop()
    finally:
        process.send_signal(signal.SIGCONT)
    try:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, stderr
        line = error_line(stderr)
        store = f"cannot reach {s3.endpoint}, the object store the actq API at {s.base_url} sent the download to"
        assert store in line, line
        assert "cannot reach the actq API" not in line and "gave up after" in line, line
        assert "actq: ConnectError" in stderr  # each retry was said
    finally:
        s3.start()
    again = subprocess.run(actq(s.base_url, *args), env=run_env(s), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert len(list((out / "activations").glob("*.safetensors"))) == 12


def test_export_stopped_by_a_503_keeps_what_it_fetched_and_resumes(s3_stack, tmp_path):
    """S3 stopped while `actq export` fetches the activations of the half of a run's samples that
    were not downloaded: the API's 503 is said as its storage being unavailable, in its words; the
    samples exported so far are kept in a partial file, the error says how many are missing and how
    to resume; the same command once S3 is back resumes from that file (the kept samples' jobs are
    deleted first, so they can only come from it)."""
    s3, s = s3_stack
    out = tmp_path / "run"
    done = subprocess.run(
        actq(s.base_url, *GSM8K_DOWNLOAD, "--out", str(out)), env=run_env(s), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    jobs = json.loads((out / "jobs.json").read_text())
    for index in range(6, 12):  # their activations must now come through the API
        (out / "activations" / f"{index}.safetensors").unlink()
    s3.stop()
    try:
        export = actq(s.base_url, "export", str(out), "--retry-timeout", "2")
        stopped = subprocess.run(export, env=run_env(s), capture_output=True, text=True, timeout=300)
        assert stopped.returncode == 2, stopped.stderr
        line = error_line(stopped.stderr)
        assert "answered that its storage is unavailable (503 storage_error: " in line, line
        assert f"S3 endpoint {s3.endpoint} is unreachable" in line and "cannot reach" not in line, line
        partial = out / "export.partial.parquet"
        assert f"the 6 samples exported so far (18 rows) are kept in {partial}, 6 samples are missing" in line
        assert "run the same command again to resume" in line and not (out / "export.parquet").exists()
        kept = pq.read_table(partial)
        assert sorted(set(kept.column("index").to_pylist())) == list(range(6))
    finally:
        s3.start()
    with s.client() as http:
        for index in range(6):  # the kept samples can only come from the partial file now
            (out / "activations" / f"{index}.safetensors").unlink()
            assert http.delete(f"/jobs/{jobs[str(index)]}").status_code == 204
    resumed = subprocess.run(export, env=run_env(s), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"exported 36 rows from 12 samples (generated 36), 6 of them kept from {partial}" in resumed.stderr
    table = pq.read_table(out / "export.parquet")
    assert sorted(table.column("index").to_pylist()) == sorted(list(range(12)) * 3)
    assert not partial.exists()

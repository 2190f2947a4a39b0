"""A whole worker lost mid-batch (its process group SIGKILLed, as when a spot machine vanishes):
nothing rejects or acknowledges its messages, so they sit in Redis's `unacked` hash and their
jobs stay `running`. With default settings (heartbeat 1 s, TTL 4 s, lost-message check 10 s,
visibility timeout 7,200 s), the next worker's lost-message check finds them (held by no live
worker, their engine's heartbeat expired) and runs them again: every job succeeds within 120 s
of the kill, each once, with its attempts recorded."""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import datetime

import pytest

from shared import keys
from shared.jobs import JobStore
from shared.registry import ModelRegistry
from shared.schemas import ModelInfo
from tests.e2e.conftest import own_stack
from tests.e2e.test_outages import assert_one_artifact_each, submit_batch, tiny_body, wait_all
from tests.support.stack import TINY

pytestmark = pytest.mark.slow

DEFAULTS = {  # the test stacks beat faster; this test runs on the shipped defaults
    "ACTQ_HEARTBEAT_INTERVAL": "1",
    "ACTQ_HEARTBEAT_TTL": "4",
    "ACTQ_LOST_MESSAGE_CHECK_SECONDS": "10",
    "ACTQ_VISIBILITY_TIMEOUT": "7200",
    "ACTQ_MAX_BATCH": "16",
}


def _running(http, ids: list[str]) -> list[str]:
    return [i for i in ids if http.get(f"/jobs/{i}").json()["status"] == "running"]


def test_kill_9_of_a_whole_worker_mid_batch_reruns_its_jobs_within_two_minutes(live, tiny_dir, tmp_path, own_redis):
    model = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-lw"}
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url, **DEFAULTS) as s, s.client() as http:
        worker = s.start_worker("w", model)
        ids = submit_batch(http, tiny_body("tiny-lw", max_tokens=200), 24)
        deadline = time.monotonic() + 60
        while len(running := _running(http, ids)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(running) >= 4, f"no batch formed: {running}\n{s.log_tail('worker-w')}"
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and its engine process: no ack, no reject
        worker.wait()
        killed = time.time()
        stranded = _running(http, ids)
        assert stranded, "every job had ended before the kill"
        s.start_worker("w2", model)
        jobs = wait_all(s, http, ids, timeout=150)
        assert [j["status"] for j in jobs] == ["succeeded"] * len(ids), [(j["status"], j["error"]) for j in jobs]
        by_id = {j["id"]: j for j in jobs}
        for job_id in stranded:
            job = by_id[job_id]
            assert job["attempts"] == 2, job
        assert all(j["attempts"] == 1 for j in jobs if j["id"] not in stranded)
        last = max(datetime.fromisoformat(j["finished_at"]).timestamp() for j in jobs)
        print(f"\n{len(stranded)} jobs running at the kill; all {len(ids)} succeeded {last - killed:.1f} s after it")
        assert last - killed < 120, f"the lost worker's jobs took {last - killed:.0f} s to finish"
        assert_one_artifact_each(s, jobs)


def test_a_job_left_running_with_no_message_on_a_dead_engine_runs_again(live, tiny_dir, redis_client):
    """The state 5 jobs were found in for 11 minutes after an engine loss: `running` on an engine
    that is gone, its broker message acknowledged (in neither the queue nor `unacked`), held by no
    worker. A worker's lost-message check finds it and it runs to success, its second attempt."""
    model = "tiny-left"
    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    registry.publish(ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": model}))  # no worker yet
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with live.client() as http:
        left, other = live.submit(http, body), live.submit(http, body)
        queue = keys.queue(model)
        message = next(m for m in redis_client.lrange(queue, 0, -1) if json.loads(m)["headers"]["id"] == left)
        assert redis_client.lrem(queue, 1, message) == 1  # its message acknowledged, gone
        record, why = JobStore(redis_client, 60).claim(left, "gone-host:4242", max_attempts=3)  # an engine now dead
        assert record is not None, why
        env = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": model, "ACTQ_LOST_MESSAGE_CHECK_SECONDS": "1"}
        live.start_worker(model, env)
        try:
            job = live.wait(http, left, timeout=60)
            assert job["status"] == "succeeded" and job["attempts"] == 2, job
            assert live.wait(http, other, timeout=60)["attempts"] == 1
            log = live.log_tail(f"worker-{model}", 200_000)
            said = f"job {left} was left running with no broker message and no task holding it"
            assert log.count(said) == 1, log[-4000:]
        finally:
            live.stop_process(f"worker-{model}")

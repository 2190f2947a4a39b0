"""A rolling upgrade with a real worker: records a newer version wrote, with values this worker
cannot read (a new `mode`; a new `status`), queued among good jobs. The good jobs run; the one
whose state it can read ends failed once, with a readable `unsupported_by_worker` error; the one
whose state it cannot read is left as it is; neither is sent again in a loop, and the worker logs
no failure to record an outcome."""

from __future__ import annotations

import json
import time

from shared import keys
from shared.registry import ModelRegistry
from shared.schemas import ModelInfo
from tests.support.stack import TINY

MODEL = "tiny-newer"
CHECK_SECONDS = 1  # the worker's lost-message check: a job sent again in a loop shows within seconds


def _rewrite(client, job_id: str, field: str, value: object) -> None:
    stored = json.loads(client.get(keys.job(job_id)))
    *parents, name = field.split(".")
    place = stored
    for part in parents:
        place = place[part]
    place[name] = value
    stored["written_by"] = "0.2.0"
    client.set(keys.job(job_id), json.dumps(stored), keepttl=True)


def test_a_worker_ends_what_a_newer_version_wrote_once_and_runs_the_rest(live, tiny_dir, redis_client):
    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    registry.publish(ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": MODEL}))  # no worker yet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with live.client() as http:
        ids = [live.submit(http, body) for _ in range(5)]
        bad, paused = ids[1], ids[3]
        _rewrite(redis_client, bad, "request.mode", "speculate")
        _rewrite(redis_client, paused, "status", "paused")
        live.start_worker(MODEL, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": MODEL, **_checks()})
        try:
            for job_id in (ids[0], ids[2], ids[4]):
                job = live.wait(http, job_id, timeout=120)
                assert job["status"] == "succeeded" and job["attempts"] == 1, job
            deadline = time.monotonic() + 60
            while json.loads(redis_client.get(keys.job(bad)))["status"] == "queued" and time.monotonic() < deadline:
                time.sleep(0.2)
            shown = http.get(f"/jobs/{bad}")  # still a record this API cannot read: named, with what it can read
            assert shown.status_code == 409, shown.text
            job = shown.json()["job"]
            assert job["status"] == "failed" and job["error"]["type"] == "unsupported_by_worker", job
            assert 'request.mode = "speculate"' in job["error"]["message"] and "actq 0.2.0" in job["error"]["message"]
            time.sleep(6 * CHECK_SECONDS)  # several lost-message checks
            log = live.log_tail(f"worker-{MODEL}", 200_000)
            assert "sent it again" not in log and "KeyError" not in log, log[-4000:]
            assert "recording its outcome failed" not in log, log[-4000:]
            assert log.count(f"job {bad} not run: unsupported by this worker") == 1, log[-4000:]
            assert log.count(f"job {paused} not run: left for a worker of the version that wrote its record") == 1
            assert json.loads(redis_client.get(keys.job(paused)))["status"] == "paused"  # left as it was
            assert not any(redis_client.llen(lane) for lane in keys.lanes(MODEL)) and redis_client.hlen("unacked") == 0
            listing = http.get("/jobs", params={"limit": 10})
            assert listing.status_code == 200
            assert {j["id"] for j in listing.json()} == {ids[0], ids[2], ids[4]}
            assert set(listing.headers["x-actq-unreadable-jobs"].split(",")) == {bad, paused}
        finally:
            live.stop_process(f"worker-{MODEL}")


def _checks() -> dict[str, str]:
    return {"ACTQ_LOST_MESSAGE_CHECK_SECONDS": str(CHECK_SECONDS)}

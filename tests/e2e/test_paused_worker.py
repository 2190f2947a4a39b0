"""A worker paused while its jobs run (SIGSTOP of its whole process group: a paused VM or a
partition does the same) past the heartbeat TTL: another worker on the same queue re-runs its jobs
(worker/lost_messages.py), then the paused one resumes and finishes them too. Issue 46 item 2:
both runs wrote the same S3 keys, so the record kept one run's outcome and the store the other's
file (sampled jobs: text from one draw, tokens from the other; greedy ones: a file whose sha256
the client refuses). Every job's record, manifest and file must agree: attempts write in folders
of their own and only the one the record names is kept."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time

import pytest
from safetensors.torch import load
from transformers import AutoTokenizer

from shared.client import Client
from tests.e2e.conftest import own_stack
from tests.e2e.test_outages import submit_batch, wait_all
from tests.support.s3_server import BUCKET

pytestmark = pytest.mark.slow

FAST_LOSS = {  # a worker looks lost 3 s after its last beat; the check confirms it 1 s later
    "ACTQ_HEARTBEAT_INTERVAL": "0.5",
    "ACTQ_HEARTBEAT_TTL": "3",
    "ACTQ_LOST_MESSAGE_CHECK_SECONDS": "1",
    "ACTQ_MAX_BATCH": "16",
}
MODEL = "tiny-pause"


def body(**sampling) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 200,
        "capture": {"modules": ["model.layers.{0,3}"], "positions": "all"},
        **sampling,
    }


def objects(s3_server, prefix: str) -> dict[str, bytes]:
    client = s3_server.client()
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listing}


def test_a_paused_worker_that_resumes_never_publishes_a_file_its_record_does_not_name(
    live, tiny_dir, tmp_path, own_redis, s3_server
):
    prefix = f"paused{os.getpid()}"  # this test's own objects in the session's SeaweedFS
    env = {**s3_server.env(prefix), "ACTQ_REDIS_URL": own_redis.url, **FAST_LOSS}
    model = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": MODEL}
    with own_stack(tmp_path / "stack", live.env, **env) as s, s.client() as http:
        paused = s.start_worker("a", model)
        # unseeded sampling: two runs of a job draw different texts; greedy: the same tokens
        ids = submit_batch(http, body(temperature=1.0), 8) + submit_batch(http, body(), 8)
        deadline = time.monotonic() + 60
        while len(running := [i for i in ids if http.get(f"/jobs/{i}").json().get("generated_tokens")]) < 4:
            assert time.monotonic() < deadline, f"no batch formed\n{s.log_tail('worker-a')}"
            time.sleep(0.05)
        os.killpg(paused.pid, signal.SIGSTOP)  # the worker and its engine: no beat, no ack, no reject
        try:
            s.start_worker("b", model)
            jobs = wait_all(s, http, ids, timeout=120)  # B re-ran what A held
        finally:
            os.killpg(paused.pid, signal.SIGCONT)
        rerun = [j["id"] for j in jobs if j["attempts"] == 2]
        assert set(running) <= set(rerun), (running, [(j["id"], j["attempts"]) for j in jobs])
        # A resumes and ends each of its runs: it finishes decoding, stores, and tries to record
        deadline = time.monotonic() + 60
        while pending := [i for i in rerun if not re.search(rf"job {i}(: attempt 1 .* lost| succeeded)", a_log(s))]:
            assert time.monotonic() < deadline, f"A never ended {pending}\n{s.log_tail('worker-a')}"
            time.sleep(0.2)
        tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
        with Client(s.base_url) as client:
            for job_id in ids:
                assert_record_manifest_and_file_agree(client, s3_server, prefix, job_id, tokenizer)
        print(f"\n{len(rerun)} of {len(ids)} jobs ran on both workers; every record, manifest and file agree")


def a_log(s) -> str:
    return s.log_tail("worker-a", 10_000_000)


def assert_record_manifest_and_file_agree(client: Client, s3_server, prefix: str, job_id: str, tokenizer) -> None:
    job = client.job(job_id)
    assert job.status == "succeeded", job.data
    manifest, usage = job.manifest, job.data["result"]["usage"]
    data = job.activations_bytes()  # the client's own check: ChecksumMismatch unless it is the record's file
    assert hashlib.sha256(data).hexdigest() == manifest["sha256"] and len(data) == manifest["bytes"]
    ids = load(data)["token_ids"]
    assert len(ids) == usage["prompt_tokens"] + usage["completion_tokens"], (job_id, len(ids), usage)
    text = tokenizer.decode(ids[usage["prompt_tokens"] :], skip_special_tokens=True)
    assert text == job.data["result"]["text"], job_id
    # in the store: the record's file and its manifest, in one attempt's folder, and nothing else
    stored = objects(s3_server, f"{prefix}/jobs/{job_id}/")
    folder = manifest["key"].rsplit("/", 1)[0]
    assert set(stored) == {f"{prefix}/{manifest['key']}", f"{prefix}/{folder}/manifest.json"}, sorted(stored)
    beside = json.loads(stored[f"{prefix}/{folder}/manifest.json"])
    assert (beside["sha256"], beside["key"]) == (manifest["sha256"], manifest["key"])
    assert folder.startswith(f"jobs/{job_id}/attempt-{job.data['attempts']}-"), folder  # the last claim's

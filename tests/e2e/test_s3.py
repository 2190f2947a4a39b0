"""Activations in a real S3-compatible server (SeaweedFS, signatures checked): the lifecycle,
presigned and proxied downloads, single-tensor reads, and failures that must not hang a job."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors

from shared.settings import Settings
from shared.storage import open_store
from shared.storage.tensors import read_tensor
from tests.support.s3_server import BUCKET, SeaweedS3
from tests.support.stack import TestStack

MESSAGES = [{"role": "user", "content": "Name three colours."}]
CAPTURE = {"modules": ["model.layers.{0,2}", "model.layers.1.mlp"], "positions": "all"}


def body(model="tiny-s3", **changes):
    return {"model": model, "messages": MESSAGES, "max_tokens": 12, "capture": CAPTURE, **changes}


@pytest.fixture
def s3_job(live_s3):
    with live_s3.client() as http:
        job = live_s3.wait(http, live_s3.submit(http, body()))
    assert job["status"] == "succeeded", (job, live_s3.log_tail("worker-tiny-s3"))
    return job


def objects(s3_server, prefix: str) -> dict[str, int]:
    listing = s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["Size"] for o in listing.get("Contents", [])}


def test_lifecycle_with_s3_storage(s3_job, s3_server):
    manifest = s3_job["activations"]
    folder = f"runs/jobs/{s3_job['id']}/{manifest['key'].split('/')[2]}"  # the attempt that ran it
    assert folder.startswith(f"runs/jobs/{s3_job['id']}/attempt-1-")
    key = f"{folder}/activations.safetensors"
    assert manifest["uri"] == f"s3://{BUCKET}/{key}" and f"runs/{manifest['key']}" == key
    stored = s3_server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert len(stored) == manifest["bytes"] and hashlib.sha256(stored).hexdigest() == manifest["sha256"]
    assert set(objects(s3_server, f"runs/jobs/{s3_job['id']}/")) == {key, f"{folder}/manifest.json"}
    tensors = load_safetensors(stored)
    assert [t["name"] for t in manifest["tensors"]] == ["model.layers.0", "model.layers.1.mlp", "model.layers.2"]
    assert tensors["model.layers.0"].shape == (s3_job["result"]["usage"]["total_tokens"] - 1, 64)


def test_presigned_and_proxied_downloads(live_s3, s3_job, s3_server):
    with live_s3.client() as http:
        redirect = http.get(f"/jobs/{s3_job['id']}/activations")
        assert redirect.status_code == 307
        url = redirect.headers["location"]
        assert url.startswith(s3_server.endpoint) and "X-Amz-Signature=" in url
        presigned = httpx.get(url)  # plain HTTP, no credentials
        proxied = http.get(f"/jobs/{s3_job['id']}/activations", params={"proxy": True})
    assert presigned.status_code == 200 and proxied.status_code == 200
    assert presigned.content == proxied.content
    assert hashlib.sha256(proxied.content).hexdigest() == s3_job["activations"]["sha256"]
    assert int(proxied.headers["content-length"]) == s3_job["activations"]["bytes"]
    assert proxied.headers["etag"] == f'"{s3_job["activations"]["sha256"]}"'
    tampered = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert httpx.get(tampered).status_code == 403


def test_single_tensor_download_reads_only_header_and_tensor(live_s3, s3_job, s3_server):
    with live_s3.client() as http:
        full = load_safetensors(http.get(f"/jobs/{s3_job['id']}/activations", params={"proxy": True}).content)
        one = http.get(f"/jobs/{s3_job['id']}/activations/model.layers.1.mlp")
        rows = http.get(f"/jobs/{s3_job['id']}/activations/model.layers.2", params={"rows": "3:7"})
        ids = http.get(f"/jobs/{s3_job['id']}/activations/token_ids", params={"rows": "5:"})
        missing = http.get(f"/jobs/{s3_job['id']}/activations/model.layers.3")
        bad_rows = http.get(f"/jobs/{s3_job['id']}/activations/model.layers.2", params={"rows": "7:3"})
    assert one.status_code == rows.status_code == ids.status_code == 200
    assert torch.equal(load_safetensors(one.content)["model.layers.1.mlp"], full["model.layers.1.mlp"])
    assert torch.equal(load_safetensors(rows.content)["model.layers.2"], full["model.layers.2"][3:7])
    assert torch.equal(load_safetensors(ids.content)["token_ids"], full["token_ids"][5:])
    assert missing.status_code == 404 and "tensors: model.layers.0" in missing.json()["detail"]
    assert missing.json()["error"] == "tensor_not_found"
    assert bad_rows.status_code == 422 and "selects nothing" in bad_rows.json()["detail"]

    store = open_store(Settings(storage_url=f"s3://{BUCKET}/runs", s3_endpoint_url=s3_server.endpoint))
    store.client = s3_server.client()  # the test process has no AWS environment of its own
    info = next(t for t in s3_job["activations"]["tensors"] if t["name"] == "model.layers.2")
    read_tensor(store, s3_job["activations"]["key"], "model.layers.2", None)
    header = store.bytes_read - info["bytes"]
    assert 8 < header < 1024  # 8-byte length + the JSON header; the other tensors are never fetched
    assert store.bytes_read <= (info["bytes"] + header) * 1.01


def test_local_download_supports_range_and_etag(live, http):
    job = live.wait(http, live.submit(http, body(model="tiny")))
    url = f"/jobs/{job['id']}/activations"
    whole = http.get(url)
    part = http.get(url, headers={"Range": "bytes=8-39"})
    assert whole.headers["etag"] == f'"{job["activations"]["sha256"]}"'
    assert part.status_code == 206 and part.content == whole.content[8:40]
    assert part.headers["content-range"] == f"bytes 8-39/{len(whole.content)}"


def test_delete_cancels_a_queued_job_and_removes_a_finished_one(live, http, s3_job, live_s3, s3_server):
    # Queued while the worker is paused (SIGSTOP: it takes nothing from the queue), then cancelled:
    # once it runs again the worker receives the message and skips the job.
    worker = live.processes["worker-tiny"].pid
    os.killpg(worker, signal.SIGSTOP)
    try:
        queued = live.submit(http, body(model="tiny", capture=None))
        cancelled = http.delete(f"/jobs/{queued}")
    finally:
        os.killpg(worker, signal.SIGCONT)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["error"]["type"] == "cancelled"
    deadline = time.monotonic() + 30
    while f"job {queued} not run" not in live.log_tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get(f"/jobs/{queued}").json()["status"] == "cancelled"
    assert f"job {queued} not run: already cancelled" in live.log_tail()

    # A finished job: record and artifacts go (local store and S3).
    done = live.wait(http, live.submit(http, body(model="tiny")))
    folder = live.storage_dir / "jobs" / done["id"]
    assert folder.is_dir()
    assert http.delete(f"/jobs/{done['id']}").status_code == 204
    assert not folder.exists() and http.get(f"/jobs/{done['id']}").status_code == 404
    with live_s3.client() as s3_http:
        job = live_s3.wait(s3_http, live_s3.submit(s3_http, body()))
        assert objects(s3_server, f"runs/jobs/{job['id']}/")
        assert s3_http.delete(f"/jobs/{job['id']}").status_code == 204
    assert objects(s3_server, f"runs/jobs/{job['id']}/") == {}


@pytest.fixture(scope="module")
def broken_s3_workers(live_s3, s3_server, tiny_dir, tmp_path_factory):
    """Workers whose S3 cannot be used: wrong secret, a missing bucket, a server that is down."""
    down = SeaweedS3(tmp_path_factory.mktemp("seaweedfs-down")).start()
    down.stop()
    base = {"ACTQ_MODEL": str(tiny_dir)}
    configs = {
        "tiny-badcreds": {**base, "AWS_SECRET_ACCESS_KEY": "wrong-secret"},
        "tiny-nobucket": {**base, "ACTQ_STORAGE_URL": "s3://no-such-bucket/runs"},
        "tiny-s3down": {**base, "ACTQ_S3_ENDPOINT_URL": down.endpoint, "ACTQ_STORAGE_OUTAGE_SECONDS": "3"},
    }
    for name, env in configs.items():
        live_s3.start_worker(name, {**env, "ACTQ_MODEL_NAME": name})
    return down


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("tiny-badcreds", "S3 rejected the credentials (SignatureDoesNotMatch)"),
        ("tiny-nobucket", "bucket 'no-such-bucket' does not exist"),
        ("tiny-s3down", "is unreachable"),
    ],
)
def test_unusable_s3_fails_the_job_clearly_and_leaves_nothing(live_s3, broken_s3_workers, s3_server, model, message):
    with live_s3.client() as http:
        started = time.monotonic()
        job = live_s3.wait(http, live_s3.submit(http, body(model=model)), timeout=120)
        assert time.monotonic() - started < 60  # failed, not hung
        assert job["status"] == "failed" and job["error"]["type"] == "storage_error"
        assert message in job["error"]["message"], job["error"]
        assert objects(s3_server, f"runs/jobs/{job['id']}/") == {}
        # The worker survives: its next job fails the same way instead of hanging or crashing.
        again = live_s3.wait(http, live_s3.submit(http, body(model=model, capture=None)), timeout=120)
        assert again["status"] == "succeeded"  # no capture, nothing to store


def test_health_reports_an_unusable_store(live_s3, tmp_path):
    env = {**live_s3.env, "ACTQ_STORAGE_URL": "s3://no-such-bucket/x"}
    with TestStack(tmp_path, env) as broken:
        broken.start_api()
        health = httpx.get(f"{broken.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["storage"] == "bucket 'no-such-bucket' does not exist"
        with live_s3.client() as http:
            assert http.get("/health").json()["storage"] == "ok"


def test_large_files_go_up_in_parts_and_appear_whole(s3_server, tmp_path, monkeypatch):
    from shared.storage.s3 import S3Store

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)  # the standard AWS chain, as a worker has it
    store = S3Store(BUCKET, "parts", endpoint_url=s3_server.endpoint, region=None, chunk_bytes=5 << 20)
    calls: list[str] = []
    store.client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    src = tmp_path / "big.bin"
    payload = bytes(range(256)) * (12 << 20 >> 8)  # 12 MiB: three parts of 5 MiB or less
    src.write_bytes(payload)
    assert (
        store.put_file("jobs/big/activations.safetensors", src)
        == f"s3://{BUCKET}/parts/jobs/big/activations.safetensors"
    )
    assert calls.count("UploadPart") == 3 and "CompleteMultipartUpload" in calls and "PutObject" not in calls
    stored = s3_server.client().get_object(Bucket=BUCKET, Key="parts/jobs/big/activations.safetensors")["Body"].read()
    assert stored == payload
    assert store.read_range("jobs/big/activations.safetensors", 5, 10) == payload[5:15]

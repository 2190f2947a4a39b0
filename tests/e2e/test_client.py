"""shared.client against the real stack (API + Redis + a worker serving the tiny model)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors

from shared import keys
from shared.cli.processes import free_port
from shared.client import BadRequest, Client, Conflict, JobFailed, NotFound, Unavailable
from shared.registry import ModelRegistry
from shared.schemas import ModelInfo
from tests.support.stack import TINY, TestStack, job_count

ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [{"role": "user", "content": "Name three colours."}]
CAPTURE = {
    "modules": ["model.layers.{1,3}", "model.layers.2.input_layernorm"],
    "hook": "output",
    "positions": "all",
    "dtype": "float32",
}
OFFLINE = "tiny-offline-client"  # not "tiny-offline": test_pipeline counts that model's queue


@pytest.fixture
def client(live):
    with Client(live.base_url, timeout=60) as c:
        yield c


@pytest.fixture
def captured(live):
    """One succeeded job with activations, shared by the tests that read them."""
    with Client(live.base_url, timeout=60) as c:
        job = c.submit(TINY, MESSAGES, max_tokens=8, capture=CAPTURE).wait(timeout=120)
        yield job.data


@pytest.fixture
def offline_model(live, redis_client):
    """A model the registry knows but no worker serves: its jobs stay queued."""
    from shared.registry import ModelRegistry
    from shared.schemas import ModelInfo

    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    registry.publish(ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": OFFLINE}))
    yield OFFLINE
    redis_client.delete(keys.model(OFFLINE), keys.queue(OFFLINE))
    redis_client.srem(keys.MODELS, OFFLINE)


def test_importing_the_client_does_not_import_torch():
    code = "import shared.client, sys; assert 'torch' not in sys.modules and 'safetensors' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_submit_wait_result_and_activations_equal_the_file(live, client, tmp_path):
    job = client.submit(TINY, MESSAGES, max_tokens=8, capture=CAPTURE)
    assert job.status == "queued" and job.result is None and job.manifest is None
    assert job.wait(timeout=120) is job and job.status == "succeeded"
    assert job.result.finish_reason == "length" and job.result.usage.completion_tokens == 8
    assert job.result.usage.total_tokens == job.result.usage.prompt_tokens + 8
    assert isinstance(job.result.text, str)
    assert client.job(job.id).data == job.data

    raw = httpx.get(job.manifest["download_url"], follow_redirects=True, timeout=60).content
    expected = load_safetensors(raw)
    tensors = job.activations()
    assert set(tensors) == set(expected) == {t["name"] for t in job.manifest["tensors"]} | {"token_ids"}
    assert all(torch.equal(tensors[name], expected[name]) for name in expected)

    path = job.download(tmp_path / "acts.safetensors")
    assert path.read_bytes() == raw and hashlib.sha256(raw).hexdigest() == job.manifest["sha256"]
    assert [p.name for p in tmp_path.iterdir()] == ["acts.safetensors"]  # no temporary file left


def test_tensor_alone_and_row_slices(live, captured):
    with Client(live.base_url) as client:
        job = client.job(captured["id"])
        everything = job.activations()
        for info in job.manifest["tensors"]:
            name = info["name"]
            assert torch.equal(job.tensor(name), everything[name])
        name = job.manifest["tensors"][0]["name"]
        rows = everything[name].shape[0]
        assert torch.equal(job.tensor(name, rows=(2, 5)), everything[name][2:5])
        assert torch.equal(job.tensor(name, rows=slice(3, None)), everything[name][3:])
        assert torch.equal(job.tensor(name, rows=slice(-4, -1)), everything[name][rows - 4 : rows - 1])


def test_submit_many_over_one_connection(live, client):
    requests = [
        {"model": TINY, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 3} for i in range(5)
    ]
    jobs = client.submit_many(requests)
    assert len({j.id for j in jobs}) == 5
    for job in jobs:
        assert job.wait(timeout=120).status == "succeeded" and job.result.usage.completion_tokens == 3
    with pytest.raises(ValueError, match="5 requests but 2 idempotency keys"):
        client.submit_many(requests, idempotency_keys=["a", "b"])


def test_submit_many_splits_batches_under_the_api_body_limit(live, client, redis_client):
    """40 requests of 100 kB each are 4 MB of JSON, over the API's default 4 MiB body limit: the
    client sends them in several batches, and every job is created once. (The model is one with a
    long context and no worker: the jobs wait queued.)"""
    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    registry.publish(
        ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": "long", "max_context": 10**6})
    )
    big = {"model": "long", "messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 1}
    jobs = client.submit_many([big] * 40, idempotency_keys=[f"split-{i}" for i in range(40)])
    assert len({j.id for j in jobs}) == 40 and job_count(redis_client) == 40


def test_api_errors_are_typed_and_carry_the_detail(client):
    with pytest.raises(BadRequest) as bad:
        client.submit(TINY, MESSAGES, max_tokens=100000)
    assert bad.value.status_code == 422 and bad.value.error_type == "invalid_request"
    assert "max_tokens 100000 exceeds the limit" in bad.value.detail and "exceeds the limit" in str(bad.value)

    with pytest.raises(BadRequest, match="name what to capture"):
        client.submit(TINY, MESSAGES, capture={"modules": []})
    with pytest.raises(ValueError, match="exactly one of messages"):
        client.submit(TINY, MESSAGES, prompt="2+3=")

    with pytest.raises(NotFound) as unknown:
        client.job("00000000-0000-4000-8000-000000000000")
    assert unknown.value.status_code == 404 and "no job with id" in str(unknown.value)
    with pytest.raises(NotFound, match="not served here"):
        client.submit("no-such-model", MESSAGES)


def test_a_raw_prompt_with_a_preset_capture(client):
    job = client.submit(TINY, prompt="2 + 3 =", max_tokens=3, capture={"preset": "residual", "layers": [0, -1]})
    job.wait(timeout=60)
    assert job.status == "succeeded", job.error
    tensors = job.activations()
    assert [t["name"] for t in job.manifest["tensors"]] == ["model.layers.0", "model.layers.3"]
    assert tensors["model.layers.3"].shape == (tensors["token_ids"].shape[0] - 1, 64)


def test_a_trace_job_scores_an_answer(client):
    turns = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    job = client.submit(
        TINY,
        turns,
        mode="trace",
        logprobs=True,
        capture={"preset": "residual", "layers": [-1], "positions": "completion", "reduce": "mean"},
    )
    job.wait(timeout=60)
    result = job.result
    assert job.status == "succeeded" and result is not None, job.error
    start, stop = result.completion_span
    assert result.text == "" and result.usage.completion_tokens == 0 and stop == result.usage.prompt_tokens - 1
    assert result.logprobs is not None and len(result.logprobs["content"]) == result.usage.prompt_tokens
    assert job.activations()["model.layers.3"].shape == (1, 64)


def test_a_failed_job_raises_job_failed_with_its_error(client):
    job = client.submit(TINY, [{"role": "user", "content": "word " * 400}], max_tokens=4)
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=120)
    assert failed.value.error_type == "context_length_exceeded" and failed.value.job is job
    assert "This model's maximum context length is 256 tokens" in str(failed.value)
    assert job.status == "failed" and job.result is None and job.error["type"] == "context_length_exceeded"


def test_idempotency_key_returns_the_same_job(client):
    key = f"client-{uuid.uuid4()}"
    first = client.submit(TINY, MESSAGES, max_tokens=2, idempotency_key=key)
    again = client.submit(TINY, MESSAGES, max_tokens=2, idempotency_key=key)
    assert again.id == first.id
    with pytest.raises(Conflict, match="used for a different request"):
        client.submit(TINY, MESSAGES, max_tokens=3, idempotency_key=key)
    batch_keys = [f"{key}-{i}" for i in range(2)]
    requests = [{"model": TINY, "messages": MESSAGES, "max_tokens": 2}] * 2
    assert [j.id for j in client.submit_many(requests, batch_keys)] == [
        j.id for j in client.submit_many(requests, batch_keys)
    ]
    first.wait(timeout=120)


def test_wait_times_out_on_a_job_no_worker_serves(client, offline_model):
    job = client.submit(offline_model, MESSAGES)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"job {job.id} is still queued after 1.5s"):
        job.wait(timeout=1.5)
    assert 1.4 < time.monotonic() - started < 5
    assert job.status == "queued"
    # Without the long poll (poll=0) the client backs off instead of busy polling.
    requests: list[httpx.Request] = []
    client._http.event_hooks["request"].append(requests.append)
    with pytest.raises(TimeoutError):
        job.wait(timeout=1.0, poll=0)
    assert 3 <= len(requests) <= 10


def test_cancel_a_queued_job(client, offline_model):
    job = client.submit(offline_model, MESSAGES)
    assert job.cancel().status == "cancelled"
    assert client.job(job.id).status == "cancelled"
    with pytest.raises(JobFailed) as cancelled:
        job.wait(timeout=5)
    assert cancelled.value.error_type == "cancelled"


def test_cancel_never_deletes_a_finished_job(client):
    job = client.submit(TINY, MESSAGES, max_tokens=2).wait(timeout=120)
    with pytest.raises(Conflict, match="already ended succeeded: there is nothing to cancel"):
        job.cancel()
    assert client.job(job.id).status == "succeeded"


def test_delete_a_finished_job(client):
    job = client.submit(TINY, MESSAGES, max_tokens=2).wait(timeout=120)
    job.delete()
    with pytest.raises(NotFound):
        client.job(job.id)


def test_unavailable_when_the_api_cannot_reach_redis(live):
    env = {**live.env, "ACTQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    with TestStack(live.root / "no-redis-client", env) as cut_off:
        cut_off.start_api()
        with Client(cut_off.base_url, timeout=20, retry_seconds=0) as client:  # the 503 itself, not waited out
            with pytest.raises(Unavailable) as health:
                client.health()
            assert health.value.status_code == 503 and "Redis cannot be reached" in health.value.detail
            with pytest.raises(Unavailable, match="cannot be reached"):
                client.submit(TINY, MESSAGES)


def test_models_and_health(client):
    assert TINY in [m["name"] for m in client.models()]
    assert client.health()["workers"][TINY] == 1


def test_activations_through_the_s3_redirect(live_s3):
    """S3 store: the download is a 307 to a presigned URL; the client follows it (dropping its
    Authorization header on the way to another origin) and checks the sha256."""
    with Client(live_s3.base_url, api_key="secret-token", timeout=60) as client:
        job = client.submit("tiny-s3", MESSAGES, max_tokens=6, capture=CAPTURE).wait(timeout=120)
        redirected, proxied = job.activations(), job.activations(proxy=True)
        assert set(redirected) == set(proxied) == {t["name"] for t in job.manifest["tensors"]} | {"token_ids"}
        for name, tensor in redirected.items():
            assert torch.equal(tensor, proxied[name]) and torch.equal(job.tensor(name), tensor)
        name = job.manifest["tensors"][1]["name"]
        assert torch.equal(job.tensor(name, rows=slice(1, 4)), redirected[name][1:4])
        job.delete()
        with pytest.raises(NotFound):
            job.refresh()

"""The whole pipeline on the tiny model: HTTP -> Redis -> Celery worker process -> safetensors -> HTTP."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared import keys
from shared.broker import make_celery
from shared.cli.local_stack import worker_command
from shared.cli.processes import free_port, spawn, stop
from shared.settings import Settings
from tests.support.reference import hooked_generate, select
from tests.support.stack import TINY, TestStack

MESSAGES = [{"role": "user", "content": "Name three colours."}]
POINTS = ["model.layers.{1,3}", "model.layers.{1,3}.input_layernorm", "model.layers.2.post_attention_layernorm"]


@pytest.fixture(scope="module")
def reference_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def job_body(**changes):
    body = {
        "model": TINY,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "capture": {"modules": POINTS, "hook": "output", "positions": "all", "dtype": "float32"},
    }
    body.update(changes)
    return body


def test_lifecycle_and_activations_equal_forward_hooks(live, http, reference_model):
    response = http.post("/jobs", json=job_body())
    assert response.status_code == 202
    queued = response.json()
    assert queued["status"] == "queued" and queued["result"] is None
    assert response.headers["location"].endswith(f"/jobs/{queued['id']}")
    job = live.wait(http, queued["id"])
    assert job["status"] == "succeeded", job
    assert job["attempts"] == 1 and job["created_at"] <= job["started_at"] <= job["finished_at"]
    usage = job["result"]["usage"]
    assert usage["completion_tokens"] == 10 and usage["total_tokens"] == usage["prompt_tokens"] + 10
    assert job["result"]["finish_reason"] == "length"

    # one INFO line per job, though the worker runs at Celery's default log level (WARNING); it is
    # written just after the outcome is recorded, so the reader that saw the outcome may be first
    deadline, lines = time.monotonic() + 10, []
    while not lines and time.monotonic() < deadline:
        lines = [x for x in live.log_tail(chars=200_000).splitlines() if f"job {queued['id']} succeeded" in x]
        time.sleep(0.05)
    assert len(lines) == 1, live.log_tail()
    line = lines[0]
    assert f"{usage['prompt_tokens']} prompt + 10 new tokens" in line and "bytes stored" in line

    manifest = job["activations"]
    download = http.get(manifest["download_url"])
    assert download.status_code == 200 and download.headers["content-type"] == "application/octet-stream"
    data = download.content
    assert int(download.headers["content-length"]) == len(data) == manifest["bytes"]
    assert hashlib.sha256(data).hexdigest() == manifest["sha256"]
    head = http.head(manifest["download_url"])  # the headers alone
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(data) and head.headers["etag"] == f'"{manifest["sha256"]}"'
    one = http.get(f"/jobs/{queued['id']}/activations/token_ids")
    head = http.head(f"/jobs/{queued['id']}/activations/token_ids")
    assert head.status_code == 200 and head.content == b"" and head.headers["etag"] == one.headers["etag"]
    assert int(head.headers["content-length"]) == len(one.content)
    tensors = load_safetensors(data)

    model, tokenizer = reference_model
    modules = [t["module"] for t in manifest["tensors"]]
    assert modules == [
        "model.layers.1",
        "model.layers.1.input_layernorm",
        "model.layers.2.post_attention_layernorm",
        "model.layers.3",
        "model.layers.3.input_layernorm",
    ]  # forward-execution order
    ids, rows, prompt_tokens = hooked_generate(model, tokenizer, MESSAGES, 10, modules)
    assert torch.equal(tensors["token_ids"], ids)
    assert tokenizer.decode(ids[prompt_tokens:], skip_special_tokens=True) == job["result"]["text"]
    assert usage["prompt_tokens"] == prompt_tokens
    for info in manifest["tensors"]:
        assert (
            info["shape"] == [prompt_tokens + 9, 64]
            and info["dtype"] == "float32"
            and info["bytes"] == (prompt_tokens + 9) * 64 * 4
        )
        assert (info["start"], info["stop"]) == (0, prompt_tokens + 9)
        assert torch.equal(tensors[info["name"]], select(rows[info["module"]], "all", prompt_tokens, 10)), info["name"]

    # The file on disk, in the folder of the attempt that ran the job, carries its own description,
    # and a manifest.json sits beside it.
    path = live.storage_dir / manifest["key"]
    assert path.parent.parent == live.storage_dir / "jobs" / job["id"] and path.parent.name.startswith("attempt-1-")
    assert manifest["uri"] == path.as_uri() and path.name == "activations.safetensors"
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
    assert meta["job_id"] == job["id"] and meta["model"] == TINY and meta["prompt_tokens"] == str(prompt_tokens)
    on_disk = json.loads((path.parent / "manifest.json").read_text())
    assert on_disk["sha256"] == manifest["sha256"] and [t["name"] for t in on_disk["tensors"]] == [
        t["name"] for t in manifest["tensors"]
    ]


def test_plain_completion_has_no_activations(live, http):
    job = live.wait(http, live.submit(http, job_body(capture=None, max_tokens=None)))
    assert job["status"] == "succeeded" and job["activations"] is None
    assert job["result"]["usage"]["completion_tokens"] == 16  # ACTQ_DEFAULT_MAX_TOKENS in the test stack
    response = http.get(f"/jobs/{job['id']}/activations")
    assert response.status_code == 404 and "captured no activations" in response.json()["detail"]


def test_same_seed_same_tokens_through_the_queue(live, http):
    sampled = dict(capture=None, temperature=1.0, top_p=0.95, max_tokens=12)
    ids = [live.submit(http, job_body(seed=s, **sampled)) for s in (11, 11, 12)]
    texts = [live.wait(http, i)["result"]["text"] for i in ids]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_stop_strings(live, http):
    full = live.wait(http, live.submit(http, job_body(capture=None, max_tokens=30)))["result"]["text"]
    stop = full.split()[len(full.split()) // 2]
    job = live.wait(http, live.submit(http, job_body(stop=[stop], max_tokens=30)))
    assert job["result"]["finish_reason"] == "stop"
    assert job["result"]["text"] == full[: full.find(stop)]
    assert job["result"]["usage"]["completion_tokens"] < 30
    # Activations still cover every token fed to the model, stop-string tokens included.
    rows = job["result"]["usage"]["total_tokens"] - 1
    assert all(t["shape"][0] == rows for t in job["activations"]["tensors"])


def test_a_failing_job_is_recorded_and_the_next_succeeds(live, http):
    long_prompt = [{"role": "user", "content": "word " * 400}]  # past the tiny model's 256-token context
    failed = live.wait(http, live.submit(http, job_body(messages=long_prompt, max_tokens=4)))
    assert failed["status"] == "failed" and failed["result"] is None and failed["activations"] is None
    assert failed["error"]["type"] == "context_length_exceeded"
    assert "This model's maximum context length is 256 tokens" in failed["error"]["message"]
    assert "Traceback" not in json.dumps(failed)
    assert http.get(f"/jobs/{failed['id']}/activations").status_code == 409
    assert live.wait(http, live.submit(http, job_body()))["status"] == "succeeded"


def test_a_storage_failure_fails_the_job_and_not_the_worker(live, http):
    # A regular file where the worker's jobs directory should be: a real write failure.
    jobs_dir = live.storage_dir / "jobs"
    aside = live.storage_dir / "jobs-aside"
    jobs_dir.rename(aside)
    jobs_dir.write_text("not a directory")
    try:
        failed = live.wait(http, live.submit(http, job_body()))
    finally:
        jobs_dir.unlink()
        aside.rename(jobs_dir)
    assert failed["status"] == "failed" and failed["error"]["type"] == "storage_error"
    assert "cannot store jobs/" in failed["error"]["message"]
    assert not list((live.storage_dir / ".tmp").iterdir())  # no partial file left
    assert live.wait(http, live.submit(http, job_body()))["status"] == "succeeded"


def test_a_redelivered_message_for_a_finished_job_does_nothing(live, http):
    job = live.wait(http, live.submit(http, job_body(capture=None)))
    celery = make_celery(Settings(redis_url=live.redis_url, model=TINY))
    celery.send_task(keys.TASK_NAME, args=[job["id"]], task_id=job["id"], queue=keys.queue(TINY))
    # A job sent after the duplicate runs after it on the one-at-a-time worker.
    after = live.wait(http, live.submit(http, job_body(capture=None)))
    assert after["status"] == "succeeded"
    again = http.get(f"/jobs/{job['id']}").json()
    assert again == job  # not re-run: same attempts, same timestamps, same result
    assert f"job {job['id']} not run: already succeeded" in live.log_tail()


def test_idempotency_key_returns_the_same_job(live, http):
    first = http.post("/jobs", json=job_body(capture=None), headers={"Idempotency-Key": "problem-17"})
    second = http.post("/jobs", json=job_body(capture=None), headers={"Idempotency-Key": "problem-17"})
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]
    live.wait(http, first.json()["id"])
    other = http.post("/jobs", json=job_body(capture=None, max_tokens=3), headers={"Idempotency-Key": "problem-17"})
    assert other.status_code == 409 and "used for a different request" in other.json()["detail"]


def test_concurrent_retries_with_one_idempotency_key_make_one_job(live, redis_client):
    ids, barrier = [], threading.Barrier(8)

    def post():
        with live.client() as own:
            barrier.wait()
            response = own.post(
                "/jobs", json=job_body(capture=None, max_tokens=2), headers={"Idempotency-Key": "race-1"}
            )
            ids.append((response.status_code, response.json()["id"]))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({job_id for _, job_id in ids}) == 1
    assert sorted(code for code, _ in ids) == [200] * 7 + [202]


def test_an_idempotency_key_whose_request_died_before_recording_is_taken_over(live, http, redis_client):
    """A key claimed by a request that never recorded its job (its process died, or Redis went
    away in between) does not block the key for the retention period: after the wait for the
    first request, a retry takes it over and queues the job once."""
    redis_client.set(keys.idempotency("orphaned-1"), str(uuid.uuid4()), ex=600)
    retry = http.post("/jobs", json=job_body(capture=None, max_tokens=2), headers={"Idempotency-Key": "orphaned-1"})
    assert retry.status_code == 202, retry.text
    assert redis_client.get(keys.idempotency("orphaned-1")).decode() == retry.json()["id"]
    again = http.post("/jobs", json=job_body(capture=None, max_tokens=2), headers={"Idempotency-Key": "orphaned-1"})
    assert again.status_code == 200 and again.json()["id"] == retry.json()["id"]
    assert live.wait(http, retry.json()["id"])["status"] == "succeeded"


def test_overlapping_requests_all_complete(live, http):
    """Many clients at once: every job runs exactly once, one at a time, none lost."""
    ids: list[str] = []
    lock = threading.Lock()

    def client():
        with live.client() as own:
            for _ in range(4):
                job_id = live.submit(
                    own, job_body(max_tokens=3, capture={"modules": ["model.layers.0"], "positions": "last"})
                )
                with lock:
                    ids.append(job_id)

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs = [live.wait(http, i) for i in ids]
    assert len(set(ids)) == 24 and all(j["status"] == "succeeded" and j["attempts"] == 1 for j in jobs)
    spans = sorted((j["started_at"], j["finished_at"]) for j in jobs)
    assert any(prev[1] > nxt[0] for prev, nxt in zip(spans, spans[1:], strict=False))  # batched: they overlapped


def test_models_and_health(live, http):
    models = http.get("/models").json()
    tiny = next(m for m in models if m["name"] == TINY)
    assert tiny["live_workers"] == 1 and tiny["num_layers"] == 4 and tiny["hidden_size"] == 64
    assert tiny["modules"][:2] == ["model", "model.embed_tokens"] and tiny["modules"][-1] == "lm_head"
    assert tiny["chat_template"] is True and tiny["presets"]["residual"] == [f"model.layers.{i}" for i in range(4)]
    assert tiny["presets"]["mlp"] == [f"model.layers.{i}.mlp" for i in range(4)]
    assert tiny["not_capturable"] == {}  # every module it runs has a capturable side
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["redis"] == "ok" and health.json()["workers"][TINY] == 1


def test_health_is_503_when_redis_is_unreachable(live):
    env = {**live.env, "ACTQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    with TestStack(live.root / "no-redis", env) as cut_off:
        cut_off.start_api()
        health = httpx.get(f"{cut_off.base_url}/health", timeout=10)
        assert health.status_code == 503 and "unreachable" in health.json()["redis"]
        post = httpx.post(f"{cut_off.base_url}/jobs", json=job_body(), timeout=20)
        assert post.status_code == 503 and "cannot be reached" in post.json()["detail"]


def test_long_poll_answers_when_the_job_finishes(live, http):
    job_id = live.submit(http, job_body(max_tokens=40))
    started = time.monotonic()
    job = http.get(f"/jobs/{job_id}", params={"wait": 30}).json()
    assert job["status"] == "succeeded" and time.monotonic() - started < 30
    # A finished job answers at once; an unknown one is still a 404; the wait is bounded.
    started = time.monotonic()
    assert http.get(f"/jobs/{job_id}", params={"wait": 30}).json()["status"] == "succeeded"
    assert time.monotonic() - started < 1
    assert http.get("/jobs/00000000-0000-4000-8000-000000000000", params={"wait": 5}).status_code == 404
    too_long = http.get(f"/jobs/{job_id}", params={"wait": 61})
    assert too_long.status_code == 422 and "wait: Input should be less than or equal to 60" in too_long.json()["detail"]


def test_long_poll_times_out_with_the_job_as_it_is(live, http, redis_client):
    """A job no worker serves stays queued; the long poll returns it after `wait` seconds."""
    from shared.registry import ModelRegistry
    from shared.schemas import ModelInfo

    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    offline = ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": "tiny-offline"})
    registry.publish(offline)
    job_id = live.submit(http, job_body(model="tiny-offline", capture=None))
    started = time.monotonic()
    job = http.get(f"/jobs/{job_id}", params={"wait": 1.5}).json()
    assert job["status"] == "queued" and 1.4 < time.monotonic() - started < 5
    assert redis_client.llen(keys.queue("tiny-offline")) == 1  # waiting for a worker, not lost
    assert "tiny-offline" not in [m["name"] for m in http.get("/models").json()]
    assert "tiny-offline" in [m["name"] for m in http.get("/models", params={"include_offline": True}).json()]


def test_a_worker_that_cannot_load_its_model_stops_with_the_reason(live, tmp_path):
    log = tmp_path / "worker-broken.log"
    env = {**live.env, "ACTQ_MODEL": str(tmp_path / "no-such-model"), "ACTQ_MODEL_NAME": "broken"}
    process = spawn(worker_command(), log, env)
    try:
        code = process.wait(timeout=120)  # the worker exits by itself (TimeoutExpired fails the test)
    finally:
        stop(process)
    text = log.read_text(errors="replace")
    assert "cannot serve model" in text and "stopping the worker" in text and "no such model folder" in text
    assert code != 0, "a worker that cannot serve its model must not exit 0 (a supervisor would see success)"
    with live.client() as http:
        assert "broken" not in http.get("/health").json()["workers"]


def test_metrics_report_jobs_queue_depth_and_durations(live, http):
    def scrape() -> dict[str, float]:
        response = http.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        values = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    before = scrape()
    ok = live.wait(http, live.submit(http, job_body(max_tokens=5)))
    bad = live.wait(
        http, live.submit(http, job_body(messages=[{"role": "user", "content": "word " * 400}], max_tokens=4))
    )
    assert ok["status"] == "succeeded" and bad["status"] == "failed"
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('actq_jobs_total{model="tiny",outcome="submitted"}') == 2
    assert delta('actq_jobs_total{model="tiny",outcome="succeeded"}') == 1
    assert delta('actq_jobs_total{model="tiny",outcome="failed"}') == 1
    assert delta('actq_generated_tokens_total{model="tiny"}') == 5
    assert delta('actq_captured_bytes_total{model="tiny"}') == ok["activations"]["bytes"]
    assert delta('actq_job_duration_seconds_count{model="tiny"}') == 2
    assert delta('actq_job_queue_wait_seconds_count{model="tiny"}') == 2
    assert (
        after['actq_job_duration_seconds_bucket{le="+Inf",model="tiny"}']
        == after['actq_job_duration_seconds_count{model="tiny"}']
    )
    assert after['actq_live_workers{model="tiny"}'] == 1 and 'actq_queue_depth{model="tiny"}' in after
    assert http.get("/health").json()["queued"]["tiny"] >= 0


def test_metrics_report_batch_sizes_occupancy_and_tokens_per_second(live, http):
    """Six jobs submitted together run as one batch; within a heartbeat the engine's step figures
    reach /metrics: every step's batch size is counted, none exceeds ACTQ_MAX_BATCH (occupancy
    at most 1), and the worker's tokens per second is reported."""

    def scrape() -> dict[str, float]:
        values = {}
        for line in http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    before = scrape()
    ids = [live.submit(http, job_body(max_tokens=24)) for _ in range(6)]
    assert all(live.wait(http, i)["status"] == "succeeded" for i in ids)
    count = 'actq_batch_size_count{model="tiny"}'
    deadline = time.monotonic() + 15
    while (after := scrape()).get(count, 0) - before.get(count, 0) < 23 and time.monotonic() < deadline:
        time.sleep(0.5)
    steps = after[count] - before.get(count, 0)
    assert steps >= 23, steps  # 24 tokens: the first from each prefill, then at least 23 steps
    total = after['actq_batch_size_sum{model="tiny"}'] - before.get('actq_batch_size_sum{model="tiny"}', 0)
    assert total / steps > 1, "the six jobs never shared a step"
    occupancy = 'actq_batch_occupancy_bucket{le="1",model="tiny"}'
    assert after[occupancy] == after['actq_batch_occupancy_count{model="tiny"}']
    assert 'actq_tokens_per_second{model="tiny"}' in after


def test_list_jobs_newest_first_with_a_status_filter(live, http):
    bad = live.wait(
        http, live.submit(http, job_body(messages=[{"role": "user", "content": "word " * 400}], max_tokens=2))
    )
    ids = [live.submit(http, job_body(capture=None, max_tokens=2)) for _ in range(3)]
    for job_id in ids:
        live.wait(http, job_id)
    listed = http.get("/jobs", params={"limit": 3}).json()
    assert [j["id"] for j in listed] == ids[::-1]
    failed = http.get("/jobs", params={"status": "failed", "limit": 1000}).json()
    assert bad["id"] in {j["id"] for j in failed} and all(j["status"] == "failed" for j in failed)
    assert http.get("/jobs", params={"status": "bogus"}).status_code == 422

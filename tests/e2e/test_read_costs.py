"""What one read costs the API (issue 22): large results are kept apart from the job's record and
streamed when asked for, tensors stream by byte range, and GET /models lists exactly the hooks
capture validation accepts.

The readers run in a niced subprocess (as in test_responsiveness) so that /health is timed by a
process of its own; the API's memory is its peak RSS (VmHWM, reset through /proc/PID/clear_refs
before the readers start) against its RSS before."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load as load_safetensors

from shared.capture_spec import resolve
from shared.client import Client
from shared.errors import CaptureSpecError
from shared.registry import ModelRegistry
from shared.schemas import CaptureSpec
from tests.e2e.conftest import own_stack
from tests.support.stack import TINY, TestStack
from tests.support.tiny_model import build

WIDE = "tiny-wide"  # 2 layers, hidden 64, MLP width 8192, 8192 positions: long traces, wide tensors
LONG_TOKENS = 4090  # digits: one token and one byte each, under ACTQ_LOGPROBS_INLINE_TOKENS (4096)

READERS = """
import sys, threading, time, httpx
base, ids, seconds = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3])
stop, counts, errors = time.monotonic() + seconds, [0] * 8, []
def read(n):
    with httpx.Client(base_url=base, timeout=60) as http:
        i = n
        while time.monotonic() < stop:
            job_id = ids[i % len(ids)]
            job = http.get(f"/jobs/{job_id}")
            with http.stream("GET", f"/jobs/{job_id}/result") as whole:
                size = sum(len(c) for c in whole.iter_bytes())
            if job.status_code != 200 or whole.status_code != 200:
                errors.append((job.status_code, whole.status_code))
            counts[n] += 1
            i += 1
threads = [threading.Thread(target=read, args=(n,)) for n in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(sum(counts), len(errors))
"""


def _status(pid: int, field: str) -> int:
    """A /proc/PID/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _reset_peak(pid: int) -> int:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS
    return _status(pid, "VmRSS")


@pytest.fixture(scope="module")
def wide(live: TestStack, tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A worker serving the wide model, and an API of its own (same Redis and store) whose memory
    the tests read; its capture budget lets a 64 MiB tensor through."""
    target = tmp_path_factory.mktemp(WIDE)
    build(
        target, tiny_dir, intermediate_size=8192, num_hidden_layers=2, max_position_embeddings=8192, scale=0.1, seed=7
    )
    budget = {"ACTQ_CAPTURE_BUDGET_BYTES": str(200 << 20)}
    live.start_worker(WIDE, {"ACTQ_MODEL": str(target), "ACTQ_MODEL_NAME": WIDE, "ACTQ_MAX_BATCH": "1", **budget})
    root = tmp_path_factory.mktemp("reads-api")
    try:
        with own_stack(root, live.env, ACTQ_STORAGE_URL=live.env["ACTQ_STORAGE_URL"], **budget) as api:
            yield api
    finally:
        live.stop_process(f"worker-{WIDE}")


def _digits(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("0123456789") for _ in range(n))


def test_readers_of_large_results_leave_health_fast_and_api_memory_flat(wide: TestStack, live: TestStack):
    """4 traces of 4,090 tokens with logprobs and top_logprobs 20 (about 5 MB of entries each,
    the most a result holds inline); 8 clients read each job and its whole result for 8 s while
    /health is timed: p99 under 500 ms, API peak RSS growth under 100 MB. Before, GET /jobs/{id}
    answered the 5 MB inline (with four readers /health reached p99 12.9 s) and GET /jobs carried
    every result."""
    with wide.client() as http:
        body = {"model": WIDE, "mode": "trace", "logprobs": True, "top_logprobs": 20}
        ids = [live.submit(http, {**body, "prompt": _digits(LONG_TOKENS, seed)}) for seed in range(4)]
        jobs = [live.wait(http, i, timeout=600) for i in ids]
        assert all(j["status"] == "succeeded" for j in jobs), [j["error"] for j in jobs]
        sizes = [len(http.get(f"/jobs/{i}").content) for i in ids]
        stored = [j["result"]["stored"] for j in jobs]
        assert all(s is not None and s["bytes"] > 4_000_000 for s in stored), stored
        assert max(sizes) < 8_000, sizes  # the record: a few KiB, not 5 MB
        whole = http.get(stored[0]["url"])
        assert len(whole.content) == stored[0]["bytes"]
        assert len(whole.json()["logprobs"]["content"]) == jobs[0]["result"]["usage"]["prompt_tokens"] == LONG_TOKENS
        listed = http.get("/jobs", params={"limit": 1000})
        assert len(listed.content) < 20_000 and {j["id"] for j in listed.json()} == set(ids)
        assert listed.json()[0]["prompt_preview"] == _digits(LONG_TOKENS, 3)[:200]
        with Client(wide.base_url) as client:  # the client fetches what the API keeps apart
            logprobs = client.job(ids[3]).logprobs
            assert logprobs is not None and len(logprobs["content"]) == LONG_TOKENS

        pid = wide.processes["api"].pid
        before = _reset_peak(pid)
        readers = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, "-c", READERS, wide.base_url, ",".join(ids), "8"],
            stdout=subprocess.PIPE,
            text=True,
        )
        latencies = []
        while readers.poll() is None:
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
        out, _ = readers.communicate()
        reads, errors = (int(x) for x in out.split())
        growth = _status(pid, "VmHWM") - before
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    print(
        f"\n{reads} reads of 4 jobs x {stored[0]['bytes']} B results by 8 clients in 8 s: /health p99 "
        f"{p99 * 1e3:.1f} ms over {len(latencies)}, API peak RSS +{growth / 1e6:.1f} MB"
    )
    assert errors == 0 and reads >= 8
    # Far under what this guards against (p99 12.9 s with four readers), with room for a busy 2-core
    # machine: a window of 50 ms failed in CI with every other test beside it. The figure itself is
    # printed above; latency targets are benchmarks' (bench/bench_hostile.py).
    assert p99 < 0.5, f"/health p99 {p99 * 1e3:.1f} ms"
    assert growth < 100e6, f"API peak RSS grew {growth / 1e6:.1f} MB"


def test_head_and_ranged_gets_of_a_large_tensor_do_not_hold_it(wide: TestStack, live: TestStack):
    """8 concurrent HEADs, then 8 concurrent GETs (whole, and rows), of a 64 MiB tensor: the API's
    peak RSS grows by far less than one tensor (before: each request read it whole, 8 x 64 MiB)."""
    capture = {"modules": ["model.layers.0.mlp.up_proj"], "positions": "all", "dtype": "float32"}
    with wide.client() as http:
        body = {"model": WIDE, "mode": "trace", "prompt": _digits(2048, 1), "capture": capture}
        job = live.wait(http, live.submit(http, body), timeout=300)
        assert job["status"] == "succeeded", job["error"]
        (info,) = job["activations"]["tensors"]
        assert info["bytes"] == 2048 * 8192 * 4 and info["sha256"]
        url = f"{wide.base_url}/jobs/{job['id']}/activations/{info['name']}"
        pid = wide.processes["api"].pid

        def run(method: str, params: dict | None = None) -> list[httpx.Response]:
            script = (
                "import sys, json, hashlib, threading, httpx\n"
                "out = [None] * 8\n"
                "def go(n):\n"
                "    with httpx.stream(sys.argv[1], sys.argv[2], params=json.loads(sys.argv[3]), timeout=120) as r:\n"
                "        h = hashlib.sha256(); size = 0\n"
                "        for c in r.iter_bytes(): h.update(c); size += len(c)\n"
                "        out[n] = [r.status_code, dict(r.headers), size, h.hexdigest()]\n"
                "ts = [threading.Thread(target=go, args=(n,)) for n in range(8)]\n"
                "[t.start() for t in ts]; [t.join() for t in ts]\n"
                "print(json.dumps(out))\n"
            )
            done = subprocess.run(
                [sys.executable, "-c", script, method, url, json.dumps(params or {})],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            return json.loads(done.stdout)

        before = _reset_peak(pid)
        heads = run("HEAD")
        head_growth = _status(pid, "VmHWM") - before
        before = _reset_peak(pid)
        gets = run("GET")
        get_growth = _status(pid, "VmHWM") - before
        rows = run("GET", {"rows": "100:612"})
        one = http.get(url, params={"rows": "0:3"})
    tensor = load_safetensors(one.content)[info["name"]]
    assert tensor.shape == (3, 8192)
    assert all(h[0] == 200 and h[2] == 0 and h[1]["etag"] == f'"{info["sha256"]}"' for h in heads)
    assert all(g[0] == 200 and g[2] == int(heads[0][1]["content-length"]) for g in gets)
    assert len({g[3] for g in gets}) == 1 and all(g[1]["x-actq-tensor-sha256"] == info["sha256"] for g in gets)
    assert all(r[0] == 200 and r[2] < 512 * 8192 * 4 + 4096 for r in rows)
    assert rows[0][1]["etag"] == f'"{info["sha256"]}-100-612"'
    print(
        f"\n8 HEADs: API peak RSS +{head_growth / 1e6:.1f} MB; 8 GETs of the {info['bytes'] / 1e6:.0f} MB "
        f"tensor: +{get_growth / 1e6:.1f} MB"
    )
    assert head_growth < 10e6 and get_growth < info["bytes"], (head_growth, get_growth)


def test_models_lists_exactly_the_hooks_validation_accepts(live: TestStack, http, redis_client):
    """Every listed module and hook validates (at the positions listed); a hook not listed is
    refused, by the API too. Before, `model.rotary_emb` was listed without a word that its output
    cannot be captured."""
    entry = next(m for m in http.get("/models").json() if m["name"] == TINY)
    model = ModelRegistry(redis_client, heartbeat_ttl=4).get(TINY)
    assert model is not None and set(entry["hooks"]) == set(entry["modules"])
    assert entry["hooks"]["model.layers.1"] == {"output": 64, "input": 64}
    assert "output" not in entry["hooks"]["model.rotary_emb"], entry["hooks"]["model.rotary_emb"]
    assert entry["last_position_only"] == ["lm_head"]
    for path, hooks in entry["hooks"].items():
        positions = "last" if path in entry["last_position_only"] else "all"
        for hook in ("output", "input"):
            spec = CaptureSpec(modules=[path], hook=hook, positions=positions)
            if hook in hooks:
                (point,) = resolve(spec, model)
                assert (point.module, point.hook) == (path, hook) and model.modules[model.module_index[path]].width(
                    hook
                ) == hooks[hook]
            else:
                with pytest.raises(CaptureSpecError, match="no capturable"):
                    resolve(spec, model)
    for path in entry["last_position_only"]:
        with pytest.raises(CaptureSpecError, match="only computes the last position"):
            resolve(CaptureSpec(modules=[path], positions="all"), model)
    refused = http.post(
        "/jobs",
        json={
            "model": TINY,
            "messages": [{"role": "user", "content": "hi"}],
            "capture": {"modules": ["model.rotary_emb"], "hook": "output"},
        },
    )
    assert refused.status_code in (400, 422) and "no capturable output" in refused.text


def test_the_openai_routes_answer_logprobs_kept_apart(live: TestStack, http):
    """A chat completion with top_logprobs 20 makes a result over ACTQ_RESULT_INLINE_BYTES: the
    job keeps it apart, and /v1/chat/completions and /v1/completions still answer every entry."""
    body = {"model": TINY, "messages": [{"role": "user", "content": "Count on."}], "max_tokens": 24}
    chat = http.post("/v1/chat/completions", json={**body, "temperature": 0, "logprobs": True, "top_logprobs": 20})
    assert chat.status_code == 200, chat.text
    job_id = chat.json()["actq"]["job_id"]
    job = http.get(f"/jobs/{job_id}").json()
    assert job["result"]["stored"] is not None and job["result"]["logprobs"]["content"] is None
    whole = http.get(f"/jobs/{job_id}/result").json()["logprobs"]["content"]
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(whole) == job["result"]["usage"]["completion_tokens"] > 0
    assert [len(e["top_logprobs"]) for e in content] == [20] * len(whole)
    assert [e["token"] for e in content] == [e["token"] for e in whole]

    echo = {"model": TINY, "prompt": _digits(120, 5), "max_tokens": 0, "echo": True, "logprobs": 20}
    legacy = http.post("/v1/completions", json=echo)
    assert legacy.status_code == 200, legacy.text
    logprobs = legacy.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 120 and all(len(t) == 20 for t in logprobs["top_logprobs"][1:])
    trace = http.get(f"/jobs/{legacy.json()['actq']['job_id']}").json()
    assert trace["result"]["stored"] is not None

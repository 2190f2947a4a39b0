"""What an nnsight job costs through actq, on the built-in SmolLM2-135M-Instruct, side by side in
one run (docs/nnsight.md):

  overhead   one trace (hidden states at three layers and the last position's logits, a GSM8K
             question as the prompt) run locally by nnsight in this process, and the same code with
             `remote=True` through the API, Redis and a worker: median of `--repeats` each, and
             the difference (serialization, HTTP and the WebSocket, the queue, the result's
             download and load)
  pause      how long a running capture batch waits for one nnsight trace: the time the job held
             the model (`result.nnsight.held_s`), while `--jobs` capture jobs decode
  capture    capture throughput (generated tokens/s of `--jobs` jobs of `--max-tokens` capturing
             the residual stream) before and after nnsight jobs have run on the worker's model,
             alternated `--repeats` times: after / before is 1.0 when nnsight leaves nothing behind

    .venv/bin/python bench/bench_nnsight.py [--repeats 10] [--jobs 8] [--max-tokens 32] [--gsm8k test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout

KEY = "bench-nnsight-key"
MODEL = "smollm2-135m"
LAYERS = (5, 15, 25)


def questions(n: int, source: Path | None) -> list[str]:
    if source is not None:
        lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        return [lines[i % len(lines)]["question"] for i in range(n)]
    return [f"Tom has {12 + i} apples and buys {3 + i} more. How many apples does he have now?" for i in range(n)]


def trace(model, prompt: str, remote: bool) -> dict:
    with model.trace(prompt, remote=remote):
        hidden = list().save()
        for i in LAYERS:
            hidden.append(model.model.layers[i].output[0, -1])
        logits = model.lm_head.output[0, -1].save()
    return {"hidden": hidden, "logits": logits}


def capture_run(base: str, texts: list[str], max_tokens: int) -> tuple[float, int]:
    """`texts` as capture jobs in one batch request; (seconds until every answer, tokens generated)."""
    capture = {"preset": "residual", "positions": "generated"}
    body = {
        "jobs": [
            {"request": {"model": MODEL, "prompt": t, "max_tokens": max_tokens, "capture": capture}} for t in texts
        ]
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    began = time.perf_counter()
    with httpx.Client(base_url=base, headers=headers, timeout=600) as http:
        ids = [j["id"] for j in http.post("/jobs/batch", json=body).raise_for_status().json()["jobs"]]
        tokens = 0
        for job_id in ids:
            while (job := http.get(f"/jobs/{job_id}", params={"wait": 30}).json())["status"] in ("queued", "running"):
                pass
            assert job["status"] == "succeeded", job
            tokens += job["result"]["usage"]["completion_tokens"]
    return time.perf_counter() - began, tokens


def nnsight_job(model, prompt: str) -> float:
    """One remote trace; the seconds its job held the model (read from the job)."""
    from nnsight.intervention.backends.remote import RemoteBackend

    backend = RemoteBackend(model.to_model_key(), blocking=False)
    with model.trace(prompt, backend=backend):
        hidden = model.model.layers[LAYERS[0]].output[0, -1].save()  # noqa: F841 - sent back by name
    while backend() is None:
        time.sleep(0.02)
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as http:
        job = http.get(f"{backend.host}/jobs/{backend.job_id}").json()
    return float(job["result"]["nnsight"]["held_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gsm8k", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from nnsight import CONFIG
    from nnsight.modeling import huggingface
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoTokenizer

    from shared.cli.local_stack import Stack
    from shared.cli.redis_server import RedisServer
    from shared.settings import Settings
    from worker.model.loading import ensure_smollm2

    folder = str(ensure_smollm2(Settings().model_cache_dir))
    huggingface._ID_CACHE[folder] = folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    local = TransformersModel(folder, task="text-generation", tokenizer=tokenizer, dispatch=True)
    client = TransformersModel(folder, task="text-generation", tokenizer=tokenizer)
    texts = questions(max(args.jobs, args.repeats), args.gsm8k)
    figures: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="actq-bench-nnsight-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        env = {
            "ACTQ_REDIS_URL": redis.url,
            "ACTQ_STORAGE_URL": Path(tmp, "data").as_uri(),
            "ACTQ_API_KEYS": KEY,
            "ACTQ_NNSIGHT_KEYS": KEY,
            "ACTQ_MAX_BATCH": str(args.jobs),
        }
        with Stack(Path(tmp), env) as stack:
            stack.start_api()
            stack.start_worker("smol", {"ACTQ_MODEL": MODEL}, timeout=600)
            CONFIG.API.HOST, CONFIG.API.APIKEY = stack.base_url, KEY
            CONFIG.APP.REMOTE_LOGGING = False
            trace(client, texts[0], True)  # warm: the worker imports nnsight on its first job
            capture_run(stack.base_url, texts[:2], 4)
            for i in range(args.repeats):
                prompt = texts[i]
                began = time.perf_counter()
                expected = trace(local, prompt, False)  # as a script runs it: autograd on, as on the worker
                figures.setdefault("local ms", []).append((time.perf_counter() - began) * 1e3)
                began = time.perf_counter()
                got = trace(client, prompt, True)
                figures.setdefault("remote ms", []).append((time.perf_counter() - began) * 1e3)
                worst = max(
                    float((a.detach() - b.detach()).abs().max())
                    for a, b in zip(got["hidden"], expected["hidden"], strict=True)
                )
                figures.setdefault("largest difference", []).append(worst)

            # the pause: nnsight jobs sent while a capture batch decodes
            held: list[float] = []
            done = threading.Event()

            def send() -> None:
                while not done.is_set():
                    held.append(nnsight_job(client, texts[len(held) % len(texts)]))

            for _ in range(max(1, args.repeats // 5)):
                done.clear()
                sender = threading.Thread(target=send)
                sender.start()
                capture_run(stack.base_url, texts[: args.jobs], args.max_tokens)
                done.set()
                sender.join()
            figures["pause ms (nnsight job held the model)"] = [h * 1e3 for h in held]

            # capture throughput before and after nnsight jobs ran
            for _ in range(max(1, args.repeats // 3)):
                seconds, tokens = capture_run(stack.base_url, texts[: args.jobs], args.max_tokens)
                figures.setdefault("capture tok/s before", []).append(tokens / seconds)
                for prompt in texts[:3]:
                    trace(client, prompt, True)
                seconds, tokens = capture_run(stack.base_url, texts[: args.jobs], args.max_tokens)
                figures.setdefault("capture tok/s after", []).append(tokens / seconds)

    median = {name: statistics.median(values) for name, values in figures.items()}
    print(f"SmolLM2-135M-Instruct, torch {torch.__version__}, {torch.get_num_threads()} threads; medians")
    for name, value in median.items():
        count = len(figures[name])
        print(f"  {name:40s} {value:12.4g}   (n={count})")
    print(f"  {'remote - local ms':40s} {median['remote ms'] - median['local ms']:12.4g}")
    print(f"  {'remote / local':40s} {median['remote ms'] / median['local ms']:12.4g}")
    print(f"  {'capture after / before':40s} {median['capture tok/s after'] / median['capture tok/s before']:12.4g}")


if __name__ == "__main__":
    main()

"""Fairness between API keys (issue 47): another key's short job, alone and beside one key's heavy
work, on the built-in model (SmolLM2-135M-Instruct) through API + Redis + one worker.

Two keys. Key B's probe is a chat completion of 4 greedy tokens; its time is measured:

  (a) alone        - nothing else runs;
  (b) long prompt  - key A's job with a `--prompt-tokens` prompt (POST /jobs, 1 token) was posted
                     1 s before: prefill chunks used to go first come, first served, so the probe
                     waited for the whole prompt;
  (c) burst        - key A's `--burst` jobs of 16 tokens were posted just before: the queue used
                     to be first in, first out across keys, so the probe waited behind all of them.

Each case runs `--runs` times (key A's jobs are waited out between runs); medians (min, max) and
each case's ratio to (a). The script talks HTTP and starts its stack from the checkout it sits in:
copy it into an older checkout to measure that one.

    python bench/bench_fairness.py [--runs 3] [--prompt-tokens 3000] [--burst 64] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.cli.local_stack import Stack  # noqa: E402
from shared.cli.redis_server import RedisServer  # noqa: E402

START_TIMEOUT = 900.0  # the worker's first start may convert the model
KEY_A, KEY_B = "bench-key-heavy-0123456789", "bench-key-light-0123456789"
MODEL = "smollm2-135m"  # the built-in model as requests name it


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def probe(client: httpx.Client) -> float:
    """Key B's short job, start to answer (seconds)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    started = time.perf_counter()
    answer = client.post("/v1/chat/completions", json=body, headers=auth(KEY_B))
    elapsed = time.perf_counter() - started
    answer.raise_for_status()
    return elapsed


def heavy(client: httpx.Client, prompt: str, max_tokens: int, count: int) -> list[str]:
    """Key A's jobs, posted without waiting; their ids."""
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0} for _ in range(count)]
    answer = client.post("/jobs/batch", json={"jobs": [{"request": b} for b in bodies]}, headers=auth(KEY_A))
    answer.raise_for_status()
    return [job["id"] for job in answer.json()["jobs"]]


def wait_out(client: httpx.Client, ids: list[str]) -> None:
    for job_id in ids:
        while True:
            job = client.get(f"/jobs/{job_id}", params={"wait": 30}, headers=auth(KEY_A)).json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                if job["status"] != "succeeded":
                    raise SystemExit(f"key A's job {job_id} ended {job['status']}: {job.get('error')}")
                break


def long_prompt(tokens: int) -> str:
    """About `tokens` tokens of plain text (SmolLM2's tokenizer: a word and its space are one)."""
    words = ["river", "stone", "cloud", "lantern", "harbor", "meadow", "copper", "violet"]
    return " ".join(words[i % len(words)] for i in range(tokens))


def summary(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"alone": [], "long prompt": [], "burst": []}
    with tempfile.TemporaryDirectory(prefix="actq-bench-fair-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        env = {
            "ACTQ_REDIS_URL": redis.url,
            "ACTQ_STORAGE_URL": (Path(tmp) / "store").as_uri(),
            "ACTQ_API_KEYS": f"{KEY_A},{KEY_B}",
            "HF_HUB_OFFLINE": os.environ["HF_HUB_OFFLINE"],
        }
        with Stack(Path(tmp), env) as stack:
            stack.start_api(wait=False)
            print("starting a worker with the built-in model...", file=sys.stderr)
            stack.start_worker("bench", timeout=START_TIMEOUT)
            with httpx.Client(base_url=stack.base_url, timeout=600) as client:
                probe(client)  # warm-up
                text = long_prompt(args.prompt_tokens)
                for run in range(args.runs):
                    times["alone"].append(probe(client))
                    ids = heavy(client, text, 1, 1)
                    time.sleep(1.0)
                    times["long prompt"].append(probe(client))
                    wait_out(client, ids)
                    ids = heavy(client, "Count from one to twenty.", 16, args.burst)
                    times["burst"].append(probe(client))
                    wait_out(client, ids)
                    print(
                        f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), file=sys.stderr
                    )
    alone = statistics.median(times["alone"])
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "prompt_tokens": args.prompt_tokens,
        "burst": args.burst,
        "seconds": {case: summary(t) for case, t in times.items()},
        "ratio_to_alone": {case: statistics.median(t) / alone for case, t in times.items()},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

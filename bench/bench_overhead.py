"""What actq costs beyond the model, end to end, on a model whose compute is nearly free.

A random Llama (4 layers, hidden 64) generates `--max-tokens` greedy tokens for `--prompts`
GSM8K-length chat prompts, side by side in one run:

  generate        plain Hugging Face `generate` on all prompts at once (left-padded), in process
  engine          the same prompts as jobs of actq's scheduler in process (no Redis, no API)
  actq            the same prompts as jobs through the API, Redis and a real worker
                  (ACTQ_MAX_BATCH = number of prompts), no capture
  actq+capture    the same, capturing every output-capturable module at generated positions
  actq+narrow     the same without lm_head (whose rows are vocabulary-wide: 196 KB a token)

Generated tokens/s per arm (median of `--repeats`) and each arm over `generate`; capture's arm
over `actq`. On a GPU a small model's step is a few milliseconds, so what this measures on the CPU
(everything around the forward pass) is the throughput a GPU would see.

    .venv/bin/python bench/bench_overhead.py [--prompts 32] [--max-tokens 64] [--repeats 3]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout


def questions(n: int) -> list[str]:
    base = (
        "Natalia sold clips to {a} of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? Think step by step."
    )
    return [base.format(a=12 + 2 * i) for i in range(n)]


def generate_arm(engine, texts: list[str], max_tokens: int) -> tuple[float, int]:
    tokenizer, model = engine.tokenizer, engine.hf
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    tokenizer.padding_side = "left"
    inputs = tokenizer(chats, return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
        )
        return time.perf_counter() - started, max_tokens * len(texts)


def engine_arm(engine, texts: list[str], max_tokens: int) -> tuple[float, int]:
    from shared.schemas import JobRequest
    from worker.scheduler import Entry, Scheduler

    seqs = [
        engine.prepare(JobRequest(model="m", messages=[{"role": "user", "content": t}]), [], max_tokens) for t in texts
    ]
    done = threading.Event()
    ended: list[object] = []

    def answer(outcome: object) -> None:
        ended.append(outcome)
        if len(ended) == len(seqs):
            done.set()

    scheduler = Scheduler(engine, max_batch=len(seqs))
    started = time.perf_counter()
    for seq in seqs:
        scheduler.submit(Entry(seq=seq, done=answer))
    scheduler.start()
    done.wait()
    elapsed = time.perf_counter() - started
    scheduler.stop()
    return elapsed, sum(len(s.generated) for s in seqs)


def stack_arm(stack, model: str, texts: list[str], max_tokens: int, capture: dict | None) -> tuple[float, int]:
    from shared.client import Client

    requests = [
        {"model": model, "messages": [{"role": "user", "content": t}], "max_tokens": max_tokens, "capture": capture}
        for t in texts
    ]
    with Client(stack.base_url, timeout=600) as client:
        started = time.perf_counter()
        jobs = client.submit_many(requests, batch_size=len(requests))
        done = [job.wait(timeout=600) for job in jobs]
        elapsed = time.perf_counter() - started
    failed = [j for j in done if j.status != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} jobs did not succeed, e.g. {failed[0].status}: {failed[0].error}")
    return elapsed, sum(j.result.usage.completion_tokens for j in done if j.result is not None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from shared.cli.local_stack import Stack
    from shared.cli.redis_server import RedisServer
    from shared.client import Client
    from shared.settings import Settings
    from tests.support.tiny_model import build
    from worker.engine import CaptureEngine
    from worker.models import ensure_smollm2, load

    texts = questions(args.prompts)
    rows: dict[str, list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="actq-bench-overhead-") as tmp:
        folder = build(Path(tmp) / "tiny", ensure_smollm2(Settings().model_cache_dir), max_position_embeddings=4096)
        engine = CaptureEngine(load(Settings(model=str(folder), model_name="m")))
        engine.hf.generation_config.eos_token_id = None  # a random model: every arm generates max_tokens
        with RedisServer(Path(tmp) / "redis") as redis:
            env = {"ACTQ_REDIS_URL": redis.url, "ACTQ_STORAGE_URL": Path(tmp, "data").as_uri()}
            with Stack(Path(tmp), env) as stack:
                stack.start_api()
                worker_env = {
                    "ACTQ_MODEL": str(folder),
                    "ACTQ_MODEL_NAME": "tiny",
                    "ACTQ_MAX_BATCH": str(args.prompts),
                    "ACTQ_TORCH_THREADS": "1",
                }
                stack.start_worker("tiny", worker_env, timeout=300)
                with Client(stack.base_url) as client:
                    info = next(m for m in client.models() if m["name"] == "tiny")
                every = [path for path in info["modules"] if "output" in info["hooks"].get(path, {})]
                capture = {"modules": every, "positions": "generated"}
                # without the vocabulary-wide lm_head: the other modules' rows are 64-256 wide
                narrow = {
                    "modules": [p for p in every if p not in info["last_position_only"]],
                    "positions": "generated",
                }
                stack_arm(stack, "tiny", texts[:2], 4, None)  # warm
                for _ in range(args.repeats):
                    rows.setdefault("generate", []).append(generate_arm(engine, texts, args.max_tokens))
                    rows.setdefault("engine", []).append(engine_arm(engine, texts, args.max_tokens))
                    rows.setdefault("actq", []).append(stack_arm(stack, "tiny", texts, args.max_tokens, None))
                    rows.setdefault("actq+capture", []).append(
                        stack_arm(stack, "tiny", texts, args.max_tokens, capture)
                    )
                    rows.setdefault("actq+narrow", []).append(stack_arm(stack, "tiny", texts, args.max_tokens, narrow))
    rate = {name: statistics.median(tokens / seconds for seconds, tokens in runs) for name, runs in rows.items()}
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{'arm':<14}{'tokens/s':>10}{'x generate':>12}")
    for name, value in rate.items():
        print(f"{name:<14}{value:>10.0f}{value / rate['generate']:>12.2f}")
    print(
        f"capture: {rate['actq+capture'] / rate['actq']:.2f}x of actq without capture ({len(capture['modules'])} modules)"
    )
    if args.json:
        args.json.write_text(json.dumps({"rates": rate, "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

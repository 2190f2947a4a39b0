"""Batched execution, end to end: GSM8K problems through the API, Redis and a real worker at
several ACTQ_MAX_BATCH values, side by side in one run, with and without capture.

Each arm starts a worker with its ACTQ_MAX_BATCH (same Redis and API), submits every problem at
once with POST /jobs/batch (zero-shot chat prompts, greedy, `--max-tokens`), and times from the
submission to the last job's end. With capture, each job keeps the residual preset at three
layers spread over the depth (2 points each), generated positions, float16 (what `actq gsm8k`
captures by default). Reported per arm: jobs/s and generated tokens/s (medians over `--repeats`),
the speedup over batch 1, and capture's cost (time with capture / time without, same batch).

Needs ../shared/data/gsm8k/test.jsonl (beside the repository); exits cleanly when it is absent.

    python bench/bench_batching.py [--problems 64] [--max-tokens 128] [--batches 1,4,8,16,32]
                                   [--repeats 1] [--json out.json] [--ceiling]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
sys.path.insert(0, str(ROOT))


def run_arm(stack, model: str, requests: list[dict]) -> tuple[float, int]:
    """Submit all, wait for all: (seconds, generated tokens)."""
    from shared.client import Client

    with Client(stack.base_url, timeout=600) as client:
        started = time.perf_counter()
        jobs = client.submit_many(requests, batch_size=len(requests))
        done = [job.wait(timeout=3600) for job in jobs]
        elapsed = time.perf_counter() - started
    failed = [j for j in done if j.status != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} jobs did not succeed, e.g. {failed[0].status}: {failed[0].error}")
    tokens = sum(j.result.usage.completion_tokens for j in done if j.result is not None)
    return elapsed, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per arm (the median is reported)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--ceiling", action="store_true", help="also plain HF generate in process at each batch size (no actq)"
    )
    args = parser.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} is absent (the GSM8K test split beside the repository)")
        return 0
    from shared.cli.gsm8k import data as gsm8k
    from shared.cli.local_stack import Stack
    from shared.cli.redis_server import RedisServer
    from shared.client import Client

    problems = gsm8k.load(str(DATA))[: args.problems]
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"command": " ".join([sys.executable, *sys.argv]), "arms": []}
    with tempfile.TemporaryDirectory(prefix="actq-bench-batching-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        env = {"ACTQ_REDIS_URL": redis.url, "ACTQ_STORAGE_URL": Path(tmp, "data").as_uri()}
        with Stack(Path(tmp), env) as stack:
            stack.start_api()
            for batch in batches:
                name = f"bench-b{batch}"
                stack.start_worker(name, {"ACTQ_MAX_BATCH": str(batch), "ACTQ_MODEL_NAME": name}, timeout=900)
                with Client(stack.base_url) as client:
                    info = next(m for m in client.models() if m["name"] == name)
                capture = gsm8k.residual_capture(info, positions="generated", dtype="float16")
                for captured in (False, True):
                    requests = [
                        {
                            "model": name,
                            "messages": gsm8k.messages(p, "zero-shot"),
                            "max_tokens": args.max_tokens,
                            **({"capture": capture} if captured else {}),
                        }
                        for p in problems
                    ]
                    runs = [run_arm(stack, name, requests) for _ in range(args.repeats)]
                    seconds = statistics.median(r[0] for r in runs)
                    tokens = runs[0][1]
                    arm = {
                        "max_batch": batch,
                        "capture": captured,
                        "seconds": seconds,
                        "all_seconds": [r[0] for r in runs],
                        "jobs_per_second": len(problems) / seconds,
                        "generated_tokens": tokens,
                        "tokens_per_second": tokens / seconds,
                    }
                    results["arms"].append(arm)
                    print(
                        f"batch {batch:>2} {'capture' if captured else 'plain  '}: {seconds:7.1f} s, "
                        f"{arm['jobs_per_second']:.2f} jobs/s, {arm['tokens_per_second']:.1f} tokens/s",
                        flush=True,
                    )
                stack.stop_process(f"worker-{name}")
    by = {(a["max_batch"], a["capture"]): a for a in results["arms"]}
    base = by.get((1, True))
    print(f"\ncommand: {results['command']}")
    print("max_batch | tokens/s capture | x batch 1 | tokens/s plain | capture cost (time capture / plain)")
    for batch in batches:
        cap, plain = by[(batch, True)], by[(batch, False)]
        speedup = cap["tokens_per_second"] / base["tokens_per_second"] if base else float("nan")
        cost = cap["seconds"] / plain["seconds"]
        cap["speedup_over_batch_1"], cap["capture_cost"] = speedup, cost
        print(
            f"{batch:>9} | {cap['tokens_per_second']:16.1f} | {speedup:9.2f} | {plain['tokens_per_second']:14.1f} | {cost:.3f}"
        )
    if args.ceiling:
        results["ceiling"] = ceiling(problems, batches, args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def ceiling(problems: list, batches: list[int], max_tokens: int) -> dict[int, float]:
    """What the hardware gives batching, without actq: plain HF `generate` in this process on the
    same model and prompts, every row generating `max_tokens` (no end-of-sequence stop), one
    left-padded call per batch of B prompts (B=1: four calls); tokens/s per B and its ratio to B=1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.cli.gsm8k import data as gsm8k
    from shared.settings import Settings
    from worker.model.loading import resolve_source

    source = resolve_source(Settings())
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    texts = [
        tokenizer.apply_chat_template(gsm8k.messages(p, "zero-shot"), add_generation_prompt=True, tokenize=False)
        for p in problems
    ]
    rates: dict[int, float] = {}
    for batch in batches:
        prompts = texts[: 4 if batch == 1 else batch]
        calls = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        started, tokens = time.perf_counter(), 0
        for chunk in calls:
            inputs = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                model.generate(
                    **inputs,
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
            tokens += max_tokens * len(chunk)
        rates[batch] = tokens / (time.perf_counter() - started)
    print("\nceiling: plain HF generate in process (no actq), every row generating --max-tokens")
    print("    batch | tokens/s | x batch 1")
    for batch, rate in rates.items():
        print(f"{batch:>9} | {rate:8.1f} | {rate / rates[batches[0]]:9.2f}")
    return rates


if __name__ == "__main__":
    sys.exit(main())

"""GSM8K at scale: how fast a whole split is queued, and what a run costs against plain generation.

  enqueue  - all 1,319 test problems (zero-shot prompts, `actq gsm8k`'s default capture: the
             model's residual preset at three blocks spread over the depth) through
             POST /jobs/batch, timed from the first byte sent to the last id received (target < 5 s).
             They go to a model name with no worker, so nothing runs; the queue is emptied after.
  run      - N problems (default 50) with the default model through `actq gsm8k`'s own code path:
             problems per minute and generated tokens per second, against plain Hugging Face
             `generate` (no queue, no capture) on the same chat-templated prompts in this process.

Needs ../shared/data/gsm8k/test.jsonl (beside the repository); exits cleanly when it is absent.

    python bench/bench_gsm8k.py [--problems 50] [--max-tokens 160] [--json out.json]
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
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def enqueue(base: str, redis_url: str, problems, capture: dict, model_info: dict) -> dict:
    import redis

    from shared import keys
    from shared.cli.gsm8k import data as gsm8k
    from shared.client import Client
    from shared.registry import ModelRegistry
    from shared.schemas import ModelInfo
    from shared.settings import Settings

    settings = Settings()
    client_redis = redis.Redis.from_url(redis_url)
    name = "enqueue-bench"
    ModelRegistry(client_redis, settings.heartbeat_ttl).publish(ModelInfo.model_validate({**model_info, "name": name}))
    requests = [
        {
            "model": name,
            "messages": gsm8k.messages(p, "zero-shot"),
            "max_tokens": 256,
            "capture": capture,
        }
        for p in problems
    ]
    times = []
    with Client(base, timeout=120) as client:
        for attempt in range(3):
            keys_ = [f"bench-{attempt}-{i}" for i in range(len(requests))]
            start = time.perf_counter()
            jobs = client.submit_many(requests, idempotency_keys=keys_, batch_size=5000)
            times.append(time.perf_counter() - start)
            assert len({j.id for j in jobs}) == len(requests)
            queued = sum(client_redis.llen(lane) for lane in keys.lanes(name))
            assert queued == len(requests), queued
            client_redis.delete(
                *keys.lanes(name), *[keys.job(j.id) for j in jobs], *[keys.idempotency(k) for k in keys_]
            )
    return {
        "jobs": len(requests),
        "seconds": times,
        "median_seconds": statistics.median(times),
        "jobs_per_second": len(requests) / statistics.median(times),
    }


def plain_generate(problems, max_tokens: int) -> dict:
    import torch

    from shared.cli.gsm8k import data as gsm8k
    from shared.settings import Settings
    from worker.model.loading import load

    loaded = load(Settings())
    tokens, seconds = 0, 0.0
    for problem in problems:
        encoded: Any = loaded.tokenizer.apply_chat_template(  # a BatchEncoding with return_dict=True
            gsm8k.messages(problem, "zero-shot"), add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        start = time.perf_counter()
        with torch.inference_mode():
            ids = loaded.model.generate(  # type: ignore[operator]  # generate is GenerationMixin's
                **encoded, max_new_tokens=max_tokens, do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id
            )
        seconds += time.perf_counter() - start
        tokens += ids.shape[1] - encoded["input_ids"].shape[1]
    return {"generated_tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} is absent (the GSM8K test split beside the repository)")
        return 0
    sys.path.insert(0, str(ROOT))
    from shared.cli import local_stack as stack
    from shared.cli.gsm8k import data as gsm8k
    from shared.cli.gsm8k.runner import run as run_gsm8k
    from shared.cli.gsm8k.scoring import fewshot_answer, gold_answer, strict_match
    from shared.client import Client
    from shared.settings import Settings

    problems = gsm8k.load(str(DATA))
    for problem in problems:  # every gold answer parses, and its few-shot form scores as itself
        assert strict_match(fewshot_answer(problem.answer)) == gold_answer(problem.answer), problem.index
    settings = Settings()
    results: dict = {"command": " ".join([sys.executable, *sys.argv])}
    with tempfile.TemporaryDirectory(prefix="actq-bench-gsm8k-") as tmp:
        os.environ["ACTQ_STORAGE_URL"] = Path(tmp, "data").as_uri()
        with stack.local_stack(settings, 900, say=print) as local:
            base = local.base_url
            with Client(base) as client:
                info = next(m for m in client.models() if m["name"] == settings.served_model_name)
            import redis

            from shared import keys

            published = redis.Redis.from_url(local.redis_url).get(keys.model(info["name"]))
            assert published is not None, f"{info['name']} is live but its description is not in Redis"
            model_info = json.loads(published)
            capture = gsm8k.residual_capture(info, positions="generated", dtype="float16")
            results["enqueue"] = enqueue(base, local.redis_url, problems, capture, model_info)
            print(
                f"enqueue: {results['enqueue']['jobs']} jobs in {results['enqueue']['median_seconds']:.2f} s (median of 3)"
            )
            started = time.perf_counter()
            summary = run_gsm8k(
                out=Path(tmp) / "run",
                dataset=str(DATA),
                limit=args.problems,
                model=info["name"],
                max_tokens=args.max_tokens,
                api=base,
                quiet=True,
            )
            wall = time.perf_counter() - started
        results["run"] = {
            "problems": summary["finished"],
            "wall_seconds": wall,
            "problems_per_minute": summary["finished"] / wall * 60,
            "generated_tokens": summary["generated_tokens"],
            "tokens_per_second": summary["generated_tokens"] / wall,
            "accuracy": summary["accuracy"],
        }
    results["plain"] = plain_generate(problems[: args.problems], args.max_tokens)
    ratio = results["run"]["tokens_per_second"] / results["plain"]["tokens_per_second"]
    results["run_over_plain_tokens_per_second"] = ratio
    print(f"command: {results['command']}")
    e, r, p = results["enqueue"], results["run"], results["plain"]
    print(
        f"  enqueue {e['jobs']} problems via POST /jobs/batch: {e['median_seconds']:.2f} s median ({e['jobs_per_second']:.0f} jobs/s), target < 5 s: {'PASS' if e['median_seconds'] < 5 else 'FAIL'}"
    )
    print(
        f"  {r['problems']}-problem run ({args.max_tokens} max tokens, residual capture): {r['problems_per_minute']:.2f} problems/min, "
        f"{r['tokens_per_second']:.2f} generated tokens/s, accuracy {r['accuracy']}"
    )
    print(
        f"  plain HF generate, same prompts: {p['tokens_per_second']:.2f} tokens/s -> the run reaches {ratio:.2f}x of it"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

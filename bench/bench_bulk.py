"""A bulk run through the whole stack beside plain `generate`, on a model whose compute is nearly free.

`--jobs` GSM8K questions (256) as chat prompts to a random Llama (4 layers, hidden 64: bench_overhead's
model), `--max-tokens` greedy tokens each, side by side in one run:

  generate        plain Hugging Face `generate` in batches of `--batch` (left-padded), in this process,
                  one torch thread
  actq            the same prompts as jobs through the API, Redis and a real worker (ACTQ_MAX_BATCH =
                  `--batch`), the worker with its default torch threads (ACTQ_TORCH_THREADS unset)
  actq torch's    (with --torch-default) the same on a second worker given torch's own default, one
                  thread per core: what the worker ran with before its default fitted the machine
  actq ready      (with --ready N) the same on a worker with ACTQ_READY_JOBS=N: it claims and prepares N
                  jobs beyond its batch, so a place that frees is taken at the next step
  actq capture    (with --capture) the default worker's jobs capturing every module at generated
                  positions but the vocabulary-wide lm_head (55 modules; issue 49's figure: >= 0.85x
                  of `actq`), each job's file written to the local store
  actq capture    (with --store-process) the same capture jobs on a second worker with
    store process ACTQ_STORE_PROCESS=true: their files stored and successes recorded by a process beside
                  its engine's (worker/results/store_process.py), not by threads sharing its GIL

Generated tokens/s per arm (median of `--runs`, the arms interleaved run by run) and each over
`generate` (target: actq >= 0.9x; with --capture also each run's capture arm over the same run's
`actq`), then bench_overhead's profile of the actq arms: where the wall time
went (the POSTs, until the last job was claimed, ran, and was answered) and the CPU seconds each
process spent (API, Redis, the Celery worker, its engine process, this client). The load average is
printed beside the figures: the machine may be shared.

    .venv/bin/python bench/bench_bulk.py [--jobs 256] [--batch 32] [--max-tokens 64] [--runs 3] [--gsm8k FILE]
                                         [--torch-default] [--ready N] [--capture] [--store-process]

`--gsm8k` defaults to ../shared/data/gsm8k/test.jsonl beside the checkout, when it is there (never
copied into the repo); without a file, one template with a number changed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench.bench_overhead and tests.support, from a checkout

from bench.bench_overhead import HEARTBEAT, Profile, print_profile, questions, stack_arm, tiny_stack  # noqa: E402

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


@dataclass
class WorkerProfile(Profile):
    """bench_overhead's profile of one worker's arm, its decoding steps read for its own model."""

    model: str = "tiny"

    def steps(self) -> tuple[float, float]:
        import redis

        from shared import stats

        with redis.Redis.from_url(self.redis_url) as client:
            found = stats.read(client, self.model)
        return found["counters"].get("decode_steps", 0.0), found["histograms"]["batch_size"]["sum"]


def generate_batches(served, texts: list[str], batch: int, max_tokens: int) -> tuple[float, int]:
    """Plain `generate` over `texts` in batches of `batch`, each left-padded to its longest prompt."""
    tokenizer, model = served.tokenizer, served.hf
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    started, tokens = time.perf_counter(), 0
    with torch.inference_mode():
        for first in range(0, len(chats), batch):
            inputs = tokenizer(chats[first : first + batch], return_tensors="pt", padding=True)
            out = model.generate(
                **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
            )
            tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    return time.perf_counter() - started, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gsm8k", type=Path, default=GSM8K if GSM8K.exists() else None, help="a GSM8K JSONL")
    parser.add_argument("--torch-default", action="store_true", help="also a worker with torch's default threads")
    parser.add_argument("--ready", type=int, default=0, help="also a worker with ACTQ_READY_JOBS=N")
    parser.add_argument("--capture", action="store_true", help="also the default worker capturing 55 modules")
    parser.add_argument("--store-process", action="store_true", help="also capture with ACTQ_STORE_PROCESS=true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from shared.settings import Settings
    from worker.engine.runtime import torch_threads_for

    texts = questions(args.jobs, args.gsm8k)
    cores = len(os.sched_getaffinity(0))
    workers: dict[str, tuple[str, dict[str, str]]] = {"actq": ("tiny", {})}
    if args.torch_default:  # torch's default: one thread per core
        workers["actq torch's"] = ("tiny-torch", {"ACTQ_TORCH_THREADS": str(cores)})
    if args.ready:  # a place taken at the next step, not after the next job's delivery, claim and tokenization
        workers["actq ready"] = ("tiny-ready", {"ACTQ_READY_JOBS": str(args.ready)})
    if args.store_process:  # its plain arm is not run: its capture arm is set beside the default worker's `actq`
        workers["actq store-process"] = ("tiny-store", {"ACTQ_STORE_PROCESS": "true"})
    rows: dict[str, list[tuple[float, int]]] = {}
    loads: list[float] = []
    with tiny_stack("actq-bench-bulk-") as (folder, served, redis, stack):
        for name, extra in workers.values():
            worker_env = {
                "ACTQ_MODEL": str(folder),
                "ACTQ_MODEL_NAME": name,
                "ACTQ_MAX_BATCH": str(args.batch),
                "ACTQ_HEARTBEAT_INTERVAL": str(HEARTBEAT),
                **extra,
            }
            stack.start_worker(name, worker_env, timeout=300)
            stack_arm(stack, name, texts[:2], 4, None)  # warm
        profiles: dict[str, Profile] = {"generate": WorkerProfile({})}  # this process's CPU
        for arm, (name, _) in workers.items():
            pids = {
                "api": stack.processes["api"].pid,
                "redis": redis.process.pid,
                "celery": stack.processes[f"worker-{name}"].pid,
                "client": psutil.Process().pid,
            }
            profiles[arm] = WorkerProfile(pids, redis.url, model=name)
        arms: dict[str, tuple[str, dict | None]] = {
            arm: (name, None) for arm, (name, _) in workers.items() if arm != "actq store-process"
        }
        profiles.pop("actq store-process", None)
        if args.capture or args.store_process:
            from shared.client import Client

            with Client(stack.base_url) as client:
                info = next(m for m in client.models() if m["name"] == "tiny")
            every = [p for p in info["modules"] if "output" in info["hooks"].get(p, {})]
            modules = [p for p in every if p not in info["last_position_only"]]  # lm_head's rows are 196 KB
            arms["actq capture"] = ("tiny", {"modules": modules, "positions": "generated"})
            profiles["actq capture"] = WorkerProfile(dict(profiles["actq"].pids), redis.url, model="tiny")
        if args.store_process:
            arms["capture store-process"] = ("tiny-store", arms["actq capture"][1])
            pids = {**profiles["actq"].pids, "celery": stack.processes["worker-tiny-store"].pid}
            profiles["capture store-process"] = WorkerProfile(pids, redis.url, model="tiny-store")
        generate_batches(served, texts[: args.batch], args.batch, 4)  # warm
        for _ in range(args.runs):
            loads.append(os.getloadavg()[0])
            cpu = sum(psutil.Process().cpu_times()[:2])
            rows.setdefault("generate", []).append(generate_batches(served, texts, args.batch, args.max_tokens))
            profiles["generate"].add("ran", rows["generate"][-1][0])
            profiles["generate"].add("cpu client", sum(psutil.Process().cpu_times()[:2]) - cpu)
            profiles["generate"].add("steps", -(-args.jobs // args.batch) * args.max_tokens)
            profiles["generate"].add("rows/step", min(args.batch, args.jobs))
            for arm, (name, capture) in arms.items():
                rows.setdefault(arm, []).append(stack_arm(stack, name, texts, args.max_tokens, capture, profiles[arm]))
    rate = {name: statistics.median(tokens / seconds for seconds, tokens in runs) for name, runs in rows.items()}
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(
        f"{args.jobs} jobs, batch {args.batch}, {args.max_tokens} tokens each; {cores} cores; the worker's default "
        f"torch threads here: {torch_threads_for(Settings(), cores)}; load average (1 min) at each run's start: "
        + ", ".join(f"{value:.2f}" for value in loads)
    )
    print(f"{'arm':<22}{'tokens/s':>10}{'x generate':>12}   runs (tokens/s)")
    for name, value in rate.items():
        each = ", ".join(f"{tokens / seconds:.0f}" for seconds, tokens in rows[name])
        print(f"{name:<22}{value:>10.0f}{value / rate['generate']:>12.2f}   {each}")
    for arm in ("actq capture", "capture store-process"):
        if arm not in rows:
            continue
        ratios = [tokens_c / seconds_c / (tokens / seconds) for (seconds, tokens), (seconds_c, tokens_c)
                  in zip(rows["actq"], rows[arm], strict=True)]  # fmt: skip
        print(
            f"{arm} (55 modules at generated positions) x actq without it, run by run: "
            f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f} (target >= 0.85)"
        )
    print_profile(profiles)
    print("\nCPU seconds per 1,000 generated tokens, every process of the arm together (medians; on a shared")
    print("machine what an arm spends says what it costs better than its wall time):")
    for arm, profile in profiles.items():
        spent = [sum(run) for run in zip(*(v for k, v in profile.runs.items() if k.startswith("cpu ")), strict=True)]
        per = statistics.median(cpu / tokens * 1000 for cpu, (_, tokens) in zip(spent, rows[arm], strict=True))
        print(f"  {arm:<22}{per:>8.3f}")
    if args.json:
        profiled = {arm: profile.runs for arm, profile in profiles.items()}
        args.json.write_text(json.dumps({"rates": rate, "runs": rows, "profile": profiled, "load": loads}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

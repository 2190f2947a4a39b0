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
over `actq`. Then the profile of the API arms: where each job's time went (from its record: the
POSTs, waiting to be claimed, running, until the client had every answer) and the CPU seconds each
process spent in the arm (API, Redis, the Celery worker, its engine process, this client), beside
the engine arm's own, to show what bounds the end-to-end figure on this machine. On a GPU a small model's step is a few milliseconds, so what this measures on the CPU
(everything around the forward pass) is the throughput a GPU would see.

    .venv/bin/python bench/bench_overhead.py [--prompts 32] [--max-tokens 64] [--repeats 3] [--gsm8k test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, from a checkout


def questions(n: int, source: Path | None = None) -> list[str]:
    """`n` questions: the first of a GSM8K JSONL file's (real prompts of varied length), or one
    template with a number changed (every prompt the same length: one prefill group)."""
    if source is not None:
        lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        return [lines[i % len(lines)]["question"] for i in range(n)]
    base = (
        "Natalia sold clips to {a} of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? Think step by step."
    )
    return [base.format(a=12 + 2 * i) for i in range(n)]


def generate_arm(served, texts: list[str], max_tokens: int) -> tuple[float, int]:
    tokenizer, model = served.tokenizer, served.hf
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


def engine_arm(served, texts: list[str], max_tokens: int) -> tuple[float, int]:
    from shared.schemas import JobRequest
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    seqs = [
        served.prepare(JobRequest(model="m", messages=[{"role": "user", "content": t}]), [], max_tokens) for t in texts
    ]
    done = threading.Event()
    ended: list[object] = []

    def answer(outcome: object) -> None:
        ended.append(outcome)
        if len(ended) == len(seqs):
            done.set()

    core = EngineCore(served, max_batch=len(seqs))
    started = time.perf_counter()
    for seq in seqs:
        core.submit(Entry(seq=seq, done=answer))
    core.start()
    done.wait()
    elapsed = time.perf_counter() - started
    core.stop()
    return elapsed, sum(len(s.generated) for s in seqs)


PHASES = ("submitted", "claimed", "ran", "answered")  # until the last job's created_at, started_at...
PROCESSES = ("api", "redis", "celery", "engine", "client")
HEARTBEAT = 0.5  # seconds: how often the worker reports its decoding steps


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process of the stack and its descendants; the
    worker's engine process (`worker.engine.process`) counted apart from the Celery worker."""
    spent = dict.fromkeys(PROCESSES, 0.0)
    for name, pid in pids.items():
        root = psutil.Process(pid)
        family = [root] if name == "client" else [root, *root.children(recursive=True)]  # the client started them all
        for process in family:
            try:
                times = process.cpu_times()
                is_engine = any("worker.engine.process" in part for part in process.cmdline())
            except psutil.NoSuchProcess:
                continue
            spent["engine" if is_engine else name] += times.user + times.system
    return spent


@dataclass
class Profile:
    """Per run of an arm: seconds per phase and CPU seconds per process (`pids`: the stack's)."""

    pids: dict[str, int]
    redis_url: str = ""
    runs: dict[str, list[float]] = field(default_factory=dict)

    def steps(self) -> tuple[float, float]:
        """The worker's decoding steps so far and the rows they ran (its heartbeat reports them)."""
        import redis

        from shared import stats

        with redis.Redis.from_url(self.redis_url) as client:
            found = stats.read(client, "tiny")
        return found["counters"].get("decode_steps", 0.0), found["histograms"]["batch_size"]["sum"]

    def add(self, name: str, value: float) -> None:
        self.runs.setdefault(name, []).append(value)


def stack_arm(
    stack, model: str, texts: list[str], max_tokens: int, capture: dict | None, profile: Profile | None = None
) -> tuple[float, int]:
    """The prompts as jobs through the API; `profile` (optional) gets this run's phases and each
    process's CPU seconds."""
    from shared.client import Client

    requests = [
        {"model": model, "messages": [{"role": "user", "content": t}], "max_tokens": max_tokens, "capture": capture}
        for t in texts
    ]
    before = cpu_seconds(profile.pids) if profile else {}
    steps_before = profile.steps() if profile else (0.0, 0.0)
    with Client(stack.base_url, timeout=600) as client:
        wall, started = time.time(), time.perf_counter()
        jobs = client.submit_many(requests, batch_size=len(requests))
        done = [job.wait(timeout=600) for job in jobs]
        elapsed = time.perf_counter() - started
    failed = [j for j in done if j.status != "succeeded"]
    if failed:
        raise SystemExit(f"{len(failed)} jobs did not succeed, e.g. {failed[0].status}: {failed[0].error}")
    if profile is not None:
        after = cpu_seconds(profile.pids)
        ends = [wall] + [
            max(datetime.fromisoformat(j.data[field]).timestamp() for j in done)
            for field in ("created_at", "started_at", "finished_at")
        ]
        ends.append(wall + elapsed)
        for phase, start, end in zip(PHASES, ends[:-1], ends[1:], strict=True):
            profile.add(phase, max(0.0, end - start))
        for name in PROCESSES:
            profile.add(f"cpu {name}", after[name] - before[name])
        time.sleep(HEARTBEAT * 3)  # until the worker's heartbeat has reported this run's steps
        steps, rows = (now - then for now, then in zip(profile.steps(), steps_before, strict=True))
        profile.add("steps", steps)
        profile.add("rows/step", rows / max(1.0, steps))
    return elapsed, sum(j.result.usage.completion_tokens for j in done if j.result is not None)


def print_profile(profiles: dict[str, Profile]) -> None:
    """Medians per arm: where the wall time went, and the CPU seconds each process spent in it."""
    columns = [*PHASES, *(f"cpu {name}" for name in PROCESSES), "steps", "rows/step"]
    print("\nprofile (medians, seconds): phases until the last job's created_at, started_at, finished_at,")
    print("and the client holding every answer; CPU seconds per process during the arm (the machine's")
    print(f"cores: {psutil.cpu_count()}; the engine arm runs in the client process)")
    print(f"{'arm':<14}" + "".join(f"{name.removeprefix('cpu '):>10}" for name in columns) + f"{'cpu/wall':>10}")
    for arm, profile in profiles.items():
        medians = {name: statistics.median(values) for name, values in profile.runs.items()}
        wall = sum(medians.get(phase, 0.0) for phase in PHASES)
        cpu = sum(value for name, value in medians.items() if name.startswith("cpu "))
        cells = "".join(f"{medians[name]:>10.3f}" if name in medians else f"{'':>10}" for name in columns[:-2])
        cells += "".join(f"{medians[name]:>10.1f}" for name in columns[-2:])
        print(f"{arm:<14}{cells}{cpu / wall:>10.2f}")


@contextmanager
def tiny_stack(prefix: str) -> Iterator[tuple[Path, Any, Any, Any]]:
    """The benches' bed: the random tiny Llama built in a temporary folder (no EOS: every arm
    generates max_tokens), loaded here as a served model for the in-process arms, and a Redis with
    an API on it for the worker arms. Yields (model folder, served model, Redis server, stack)."""
    from shared.cli.local_stack import Stack
    from shared.cli.redis_server import RedisServer
    from shared.settings import Settings
    from tests.support.tiny_model import build
    from worker.batch.served import ServedModel
    from worker.model.loading import ensure_smollm2, load

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        folder = build(Path(tmp) / "tiny", ensure_smollm2(Settings().model_cache_dir), max_position_embeddings=4096)
        served = ServedModel(load(Settings(model=str(folder), model_name="m")))
        served.hf.generation_config.eos_token_id = None  # a random model: every arm generates max_tokens
        with RedisServer(Path(tmp) / "redis") as redis:
            env = {"ACTQ_REDIS_URL": redis.url, "ACTQ_STORAGE_URL": Path(tmp, "data").as_uri()}
            with Stack(Path(tmp), env) as stack:
                stack.start_api()
                yield folder, served, redis, stack


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gsm8k", type=Path, help="a GSM8K JSONL file: its first questions (varied lengths)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from shared.client import Client

    texts = questions(args.prompts, args.gsm8k)
    rows: dict[str, list[tuple[float, int]]] = {}
    with tiny_stack("actq-bench-overhead-") as (folder, served, redis, stack):
        worker_env = {
            "ACTQ_MODEL": str(folder),
            "ACTQ_MODEL_NAME": "tiny",
            "ACTQ_MAX_BATCH": str(args.prompts),
            "ACTQ_TORCH_THREADS": "1",
            "ACTQ_HEARTBEAT_INTERVAL": str(HEARTBEAT),
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
        pids = {
            "api": stack.processes["api"].pid,
            "redis": redis.process.pid,
            "celery": stack.processes["worker-tiny"].pid,
            "client": psutil.Process().pid,
        }
        profiles = {arm: Profile(pids, redis.url) for arm in ("engine", "actq", "actq+capture", "actq+narrow")}
        captures = {"actq": None, "actq+capture": capture, "actq+narrow": narrow}
        stack_arm(stack, "tiny", texts[:2], 4, None)  # warm
        for _ in range(args.repeats):
            rows.setdefault("generate", []).append(generate_arm(served, texts, args.max_tokens))
            cpu = sum(psutil.Process().cpu_times()[:2])
            rows.setdefault("engine", []).append(engine_arm(served, texts, args.max_tokens))
            profiles["engine"].add("ran", rows["engine"][-1][0])
            profiles["engine"].add("cpu client", sum(psutil.Process().cpu_times()[:2]) - cpu)
            profiles["engine"].add("steps", args.max_tokens - 1)  # all join at once; prefill gives the first
            profiles["engine"].add("rows/step", len(texts))
            for arm, spec in captures.items():
                run = stack_arm(stack, "tiny", texts, args.max_tokens, spec, profiles[arm])
                rows.setdefault(arm, []).append(run)
    rate = {name: statistics.median(tokens / seconds for seconds, tokens in runs) for name, runs in rows.items()}
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{'arm':<14}{'tokens/s':>10}{'x generate':>12}")
    for name, value in rate.items():
        print(f"{name:<14}{value:>10.0f}{value / rate['generate']:>12.2f}")
    print(
        f"capture: {rate['actq+capture'] / rate['actq']:.2f}x of actq without capture ({len(capture['modules'])} modules)"
    )
    print_profile(profiles)
    if args.json:
        profiled = {arm: profile.runs for arm, profile in profiles.items()}
        args.json.write_text(json.dumps({"rates": rate, "runs": rows, "profile": profiled}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

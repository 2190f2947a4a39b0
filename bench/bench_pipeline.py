"""What activation capture and the job pipeline cost on top of plain generation.

For the default model, one chat prompt, N new tokens (32), greedy, capturing the outputs of three
decoder layers plus their input_layernorm and post_attention_layernorm at every position (fp32),
this times three arms:

  (a) plain  - `model.generate` (Hugging Face) with no capture, under torch.inference_mode;
  (b) engine - `ServedModel.run` alone, in this process: capture hooks copying the kept rows
               of every step to the CPU, the [T, H] tensors (what the capture itself costs);
  (c) job    - a whole job: POST /jobs -> API -> Redis -> Celery worker (the same engine) ->
               safetensors file + manifest -> record -> GET /jobs/{id} shows `succeeded`
               (what the queue, process hops and storage add).

and prints medians (with min and max) over --runs runs and the ratios b/a and c/b against the
targets b/a <= 1.10 and c/b <= 1.05.

Fairness. The three arms do the same work: the same chat-templated input ids, the same generation
kwargs (the engine's own), and a prompt whose greedy completion does not reach EOS within N
tokens (min_new_tokens is not used: it would add a logits processor to one arm only); every run
asserts exactly N new tokens and the same tokens in every arm. This process
and the worker use the same torch thread count; while (c) runs this process only waits on one
long poll (GET /jobs/{id}?wait=60), its own model idle. Arms are interleaved run by run
(a, b, c, a, b, c, ...) after one warm-up of each, so drift (thermal, other load) hits all alike.

    python bench/bench_pipeline.py [--runs 5] [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import gc
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import torch

from shared.capture_spec import resolve
from shared.cli.local_stack import Stack
from shared.cli.redis_server import RedisServer
from shared.schemas import CaptureSpec, ChatMessage, JobRequest
from shared.settings import Settings
from worker.batch.served import ServedModel
from worker.model.loading import load

LAYERS = (7, 15, 23)
# A word problem whose greedy completion runs past 32 tokens (every run checks it did).
DEFAULT_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
TARGET_B_OVER_A = 1.10
TARGET_C_OVER_B = 1.05
POLL_WAIT = 60  # seconds one long poll (GET /jobs/{id}?wait=) may wait in arm (c)
SETTLE = 0.2  # idle seconds before each timed run: let spinning OpenMP threads go to sleep
START_TIMEOUT = 900.0  # the worker's first start may convert the model
JOB_TIMEOUT = 120.0  # a 32-token job takes seconds; a stuck one (crashed task) fails the bench
ARMS = ("a", "b", "c")
ARM_NAMES = {"a": "plain HF generate", "b": "capture engine", "c": "job via API+Redis+worker"}


class BenchError(RuntimeError):
    """The arms did not do the work the benchmark compares: the numbers would mean nothing."""


@dataclass
class Setup:
    tokens: int
    request: JobRequest
    served: ServedModel
    points: list
    prompt: dict  # input_ids, attention_mask: exactly what the engine feeds the model
    kwargs: dict  # generation kwargs, the engine's own
    expected: list[int] | None = None  # the new token ids, fixed by the first run


# -- the request ----------------------------------------------------------------------------


def generate_settings(request: JobRequest) -> dict:
    """The `generate` settings that pick tokens for this request: transformers' own processors for
    what it has (the reference arm; OpenAI's presence and frequency penalties it has not)."""
    if request.samples:
        settings: dict = {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p}
        if request.top_k > 0:  # otherwise the model's generation config's own, as `generate` has it
            settings["top_k"] = request.top_k
        if request.min_p:
            settings["min_p"] = request.min_p
    else:
        settings = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if request.repetition_penalty != 1.0:
        settings["repetition_penalty"] = request.repetition_penalty
    if request.min_tokens:
        settings["min_new_tokens"] = request.min_tokens
    if request.logit_bias:
        settings["sequence_bias"] = {(token,): bias for token, bias in request.logit_bias.items()}
    return settings


def capture_modules(layers: tuple[int, ...]) -> list[str]:
    indices = ",".join(map(str, layers))
    return [
        f"model.layers.{{{indices}}}",
        f"model.layers.{{{indices}}}.input_layernorm",
        f"model.layers.{{{indices}}}.post_attention_layernorm",
    ]


def build_request(model: str, tokens: int, layers: tuple[int, ...]) -> JobRequest:
    return JobRequest(
        model=model,
        messages=[ChatMessage(role="user", content=DEFAULT_PROMPT)],
        max_tokens=tokens,
        temperature=0.0,
        capture=CaptureSpec(modules=capture_modules(layers), hook="output", positions="all", dtype="float32"),
    )


def setup(settings: Settings, tokens: int, layers: tuple[int, ...]) -> Setup:
    loaded = load(settings)
    served = ServedModel(loaded)
    request = build_request(settings.served_model_name, tokens, layers)
    points = resolve(request.capture, served.info)
    expected_points = 3 * len(layers)
    if len(points) != expected_points:
        raise BenchError(f"capture spec resolved to {len(points)} points, expected {expected_points}")
    prompt = served.encode(request)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else loaded.tokenizer.eos_token_id
    kwargs = {"max_new_tokens": tokens, "pad_token_id": pad, **generate_settings(request)}
    return Setup(tokens, request, served, points, prompt, kwargs)


def check_tokens(s: Setup, arm: str, new_ids: list[int]) -> None:
    """Every run of every arm must produce exactly the same N new tokens."""
    if len(new_ids) != s.tokens:
        raise BenchError(
            f"arm {arm} generated {len(new_ids)} tokens, not {s.tokens}: the prompt reached EOS early, "
            "so the arms would not do equal work; use fewer --tokens"
        )
    if s.expected is None:
        s.expected = new_ids
    elif new_ids != s.expected:
        raise BenchError(f"arm {arm} generated different tokens from the first run: greedy decoding diverged")


# -- the three arms -------------------------------------------------------------------------


def run_plain(s: Setup) -> float:
    prompt_len = s.prompt["input_ids"].shape[1]
    model = s.served.hf
    start = time.perf_counter()
    with torch.inference_mode():
        ids = model.generate(**s.prompt, **s.kwargs)
    elapsed = time.perf_counter() - start
    check_tokens(s, "a", ids[0, prompt_len:].tolist())
    return elapsed


def run_engine(s: Setup) -> tuple[float, int]:
    start = time.perf_counter()
    generation = s.served.run(s.request, s.points, s.tokens)
    elapsed = time.perf_counter() - start
    if generation.completion_tokens != s.tokens or generation.finish_reason != "length":
        raise BenchError(f"arm b: {generation.completion_tokens} tokens, finish_reason={generation.finish_reason}")
    check_tokens(s, "b", generation.token_ids[generation.prompt_tokens :].tolist())
    if len(generation.captured) != len(s.points):
        raise BenchError(f"arm b captured {len(generation.captured)} tensors for {len(s.points)} points")
    captured = sum(c.tensor.numel() * c.tensor.element_size() for c in generation.captured)
    return elapsed, captured


def run_job(s: Setup, client: httpx.Client, body: dict) -> tuple[float, dict, int]:
    """POST the job, then wait for it with the API's long poll (`GET /jobs/{id}?wait=`): one
    request answered when the worker records the job, so no busy polling competes with the worker
    for these 2 cores and no poll interval is added to (c)."""
    start = time.perf_counter()
    response = client.post("/jobs", json=body)
    if response.status_code != 202:
        raise BenchError(f"POST /jobs answered {response.status_code}: {response.text}")
    job_id = response.json()["id"]
    deadline = start + JOB_TIMEOUT
    polls = 0
    while True:
        job = client.get(f"/jobs/{job_id}", params={"wait": POLL_WAIT}).json()
        polls += 1
        if job["status"] in ("succeeded", "failed", "cancelled"):
            break
        if time.perf_counter() > deadline:
            raise BenchError(f"job {job_id} still {job['status']} after {JOB_TIMEOUT:.0f}s")
    elapsed = time.perf_counter() - start
    if job["status"] != "succeeded":
        raise BenchError(f"job {job_id} {job['status']}: {job.get('error')}")
    check_job(s, job)
    return elapsed, job, polls


def job_phases(job: dict, elapsed: float) -> dict[str, float]:
    """Where (c)'s time went, from the job record's timestamps: waiting in the queue (created ->
    claimed by the worker), in the worker (claimed -> recorded, incl. engine and file), the rest
    (POST before the record exists, and noticing the final state)."""
    created, started, finished = (datetime.fromisoformat(job[k]) for k in ("created_at", "started_at", "finished_at"))
    queue, worker = (started - created).total_seconds(), (finished - started).total_seconds()
    return {"queue_s": queue, "worker_s": worker, "rest_s": elapsed - queue - worker}


def check_job(s: Setup, job: dict) -> None:
    usage, reason = job["result"]["usage"], job["result"]["finish_reason"]
    if usage["completion_tokens"] != s.tokens or reason != "length":
        raise BenchError(f"arm c: {usage['completion_tokens']} tokens, finish_reason={reason}")
    if usage["prompt_tokens"] != s.prompt["input_ids"].shape[1]:
        raise BenchError(
            f"arm c: the worker saw {usage['prompt_tokens']} prompt tokens, this process encoded a different count"
        )
    expected_text = s.served.tokenizer.decode(s.expected, skip_special_tokens=True)
    if job["result"]["text"] != expected_text:
        raise BenchError("arm c generated a different text from arms a and b")
    names = [t["name"] for t in job["activations"]["tensors"]]
    if names != [p.name for p in s.points]:
        raise BenchError(f"arm c captured {names}, expected {[p.name for p in s.points]}")


# -- the stack for arm (c) ------------------------------------------------------------------


class JobStack:
    """Embedded Redis, a worker and the API (shared.cli.local_stack), all in a temp dir; `close`
    stops everything."""

    def __init__(self, settings: Settings, threads: int, root: Path) -> None:
        self.settings, self.threads, self.root = settings, threads, root
        self.redis: RedisServer | None = None
        self.stack: Stack | None = None

    def start(self) -> str:
        self.redis = RedisServer(self.root / "redis").start()
        env = {
            "ACTQ_REDIS_URL": self.redis.url,
            "ACTQ_STORAGE_URL": (self.root / "storage").as_uri(),
            "ACTQ_TORCH_THREADS": str(self.threads),  # the worker computes with as many threads as we do
            "HF_HUB_OFFLINE": os.environ["HF_HUB_OFFLINE"],
        }
        self.stack = Stack(self.root, env)
        self.stack.start_api(wait=False)
        self.stack.start_worker("bench", timeout=START_TIMEOUT)
        return self.stack.base_url

    def _worker_log(self) -> str:
        return self.stack.log_tail("worker-bench", 10**9) if self.stack else ""

    def log_tail(self, chars: int = 3000) -> str:
        return self._worker_log()[-chars:]

    def worker_phases(self) -> list[tuple[float, float]]:
        """(generate ms, store ms) per job, from the worker's own log lines."""
        import re

        return [
            (float(g), float(w))
            for g, w in re.findall(r"generate ([0-9.]+) ms, store ([0-9.]+) ms", self._worker_log())
        ]

    def close(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        if self.redis is not None:
            self.redis.stop()


# -- running and reporting ------------------------------------------------------------------


def settle() -> None:
    gc.collect()
    time.sleep(SETTLE)


def run_all(s: Setup, client: httpx.Client, runs: int) -> tuple[dict[str, list[float]], dict]:
    """One warm-up of each arm, then `runs` rounds of a, b, c."""
    body = s.request.model_dump(mode="json", exclude_none=True)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    sizes: dict = {"polls_per_job": [], "job_phases": []}
    for round_ in range(runs + 1):
        settle()
        a = run_plain(s)
        settle()
        b, sizes["captured_tensor_bytes"] = run_engine(s)
        settle()
        c, job, polls = run_job(s, client, body)
        sizes["job_tensor_bytes"] = sum(t["bytes"] for t in job["activations"]["tensors"])
        sizes["job_file_bytes"] = job["activations"]["bytes"]
        if sizes["job_tensor_bytes"] != sizes["captured_tensor_bytes"]:
            raise BenchError(
                f"arm c captured {sizes['job_tensor_bytes']:,} bytes, arm b {sizes['captured_tensor_bytes']:,}"
            )
        label = "warm-up" if round_ == 0 else f"run {round_}/{runs}"
        print(
            f"  {label:<9} a={a * 1000:8.1f} ms  b={b * 1000:8.1f} ms  c={c * 1000:8.1f} ms ({polls} polls)", flush=True
        )
        if round_ > 0:
            sizes["polls_per_job"].append(polls)
            sizes["job_phases"].append(job_phases(job, c))
            for arm, value in zip(ARMS, (a, b, c), strict=True):
                times[arm].append(value)
    return times, sizes


def summarize(times: dict[str, list[float]]) -> dict:
    arms = {
        arm: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs_s": v}
        for arm, v in times.items()
    }
    b_over_a = arms["b"]["median_s"] / arms["a"]["median_s"]
    c_over_b = arms["c"]["median_s"] / arms["b"]["median_s"]
    paired = {
        "b/a": statistics.median(b / a for a, b in zip(times["a"], times["b"], strict=True)),
        "c/b": statistics.median(c / b for b, c in zip(times["b"], times["c"], strict=True)),
    }
    return {
        "arms": arms,
        "paired_ratios": paired,  # median of the per-round ratios: less sensitive to drift between rounds
        "ratios": {
            "b/a": {"value": b_over_a, "target": TARGET_B_OVER_A, "pass": b_over_a <= TARGET_B_OVER_A},
            "c/b": {"value": c_over_b, "target": TARGET_C_OVER_B, "pass": c_over_b <= TARGET_C_OVER_B},
        },
    }


def environment(s: Setup, threads: int) -> dict:
    import transformers

    loaded = s.served.loaded
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "model": loaded.name,
        "model_source": loaded.source,
        "device": loaded.device,
        "dtype": loaded.dtype,
        "prompt_tokens": int(s.prompt["input_ids"].shape[1]),
        "new_tokens": s.tokens,
        "capture": s.request.capture.model_dump(),
        "capture_points": [p.name for p in s.points],
    }


def report(command: str, env: dict, summary: dict, sizes: dict, runs: int) -> None:
    print(f"\ncommand: {command}")
    for key in (
        "python",
        "platform",
        "torch",
        "transformers",
        "torch_threads",
        "cpu_count",
        "cpus_usable",
        "model",
        "device",
        "dtype",
        "prompt_tokens",
        "new_tokens",
    ):
        print(f"  {key:<14} {env[key]}")
    print(f"  {'capture':<14} {len(env['capture_points'])} points, output, positions=all, float32:")
    print(f"  {'':<14} {', '.join(env['capture_points'])}")
    print(
        f"  captured bytes per job: {sizes['captured_tensor_bytes']:,} in tensors "
        f"(job file {sizes['job_file_bytes']:,} bytes incl. token_ids and header)"
    )
    print(
        f"  GET /jobs/{{id}}?wait={POLL_WAIT} requests per job (median): {statistics.median(sizes['polls_per_job']):g}"
    )
    phases = {k: statistics.median(p[k] for p in sizes["job_phases"]) for k in ("queue_s", "worker_s", "rest_s")}
    print(
        f"  (c) split (medians): queue {phases['queue_s'] * 1000:.1f} ms, worker {phases['worker_s'] * 1000:.1f} ms, "
        f"POST + noticing {phases['rest_s'] * 1000:.1f} ms"
    )
    if sizes.get("worker_generate_ms"):
        print(
            f"  inside the worker (medians): engine.run {statistics.median(sizes['worker_generate_ms']):.1f} ms, "
            f"store {statistics.median(sizes['worker_store_ms']):.1f} ms"
        )
    print(f"\nmedian over {runs} runs (min .. max):")
    for arm, stats in summary["arms"].items():
        print(
            f"  ({arm}) {ARM_NAMES[arm]:<26} {stats['median_s'] * 1000:8.1f} ms "
            f"({stats['min_s'] * 1000:.1f} .. {stats['max_s'] * 1000:.1f})"
        )
    print()
    for name, ratio in summary["ratios"].items():
        verdict = "PASS" if ratio["pass"] else "FAIL"
        paired = summary["paired_ratios"][name]
        print(
            f"  {name} = {ratio['value']:.3f}  (target <= {ratio['target']:.2f})  {verdict}   median of per-round ratios {paired:.3f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs per arm after one warm-up (default 15)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per run (default 32)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tokens < 1:
        parser.error("--runs and --tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv])
    settings = Settings()
    print(f"loading {settings.model} in this process", flush=True)
    s = setup(settings, args.tokens, LAYERS)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="actq-bench-") as tmp:
        pipeline = JobStack(settings, threads, Path(tmp))
        try:
            print("starting Redis, a worker and the API", flush=True)
            base = pipeline.start()
            print(f"timing: 1 warm-up + {args.runs} runs of a, b, c ({args.tokens} tokens each)", flush=True)
            with httpx.Client(base_url=base, timeout=30) as client:
                times, sizes = run_all(s, client, args.runs)
            phases = pipeline.worker_phases()[1:]  # without the warm-up
            sizes["worker_generate_ms"] = [g for g, _ in phases]
            sizes["worker_store_ms"] = [w for _, w in phases]
        except BenchError:
            print(f"worker log (tail):\n{pipeline.log_tail()}", file=sys.stderr)
            raise
        finally:
            pipeline.close()
    summary = summarize(times)
    env = environment(s, threads)
    report(command, env, summary, sizes, args.runs)
    if args.json:
        document = {"command": command, "environment": env, "runs": args.runs, "sizes": sizes, **summary}
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

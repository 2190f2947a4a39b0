"""Trace jobs, end to end: GSM8K gold solutions traced through the API, Redis and a real worker
at ACTQ_MAX_BATCH 1 and 16, against a plain Hugging Face forward pass over the same tokens.

1. Throughput. `--problems` gold solutions (the zero-shot user turn, then the gold solution as the
   assistant's reply: what `actq gsm8k --capture-on gold` traces), captured at three residual
   layers (a quarter, half and three quarters of the depth), every position, float16. Arms:
   - HF one at a time: `model(input_ids, logits_to_keep=1)` per text, forward hooks copying the
     same three layers' outputs to CPU float16 (the same capture work), in this process;
   - HF batched: left-padded batches of `--batch` texts with an attention mask and position ids,
     as the worker's `Decoder.trace` runs them (same hooks, each text's own rows copied);
   - actq at ACTQ_MAX_BATCH=1 and at `--batch`: every text submitted at once (POST /jobs/batch),
     timed from the submission to the last job's success.
   The HF arms run before any stack is started (no competition for the cores), with the worker's
   torch thread count (ACTQ_TORCH_THREADS, else torch's default). Medians over `--repeats`.
2. `reduce`: `--reduce-jobs` traces of about `--reduce-tokens` tokens (the gold solutions whose
   rendered trace is closest to it), every layer's residual, every position, float32, with
   `reduce: "none"` and `"mean"` at ACTQ_MAX_BATCH=`--batch`: stored file size (manifest `bytes`),
   per-job time (the job records' started_at..finished_at), the arm's wall time, and a check that
   each mean file's tensors equal the mean over rows of the matching none file's.
3. The API's submit-time capture estimate (`shared.capture_spec.estimate`, as api/submit_checks.py plans
   a job) against the captured tensors' stored bytes (token_ids excluded), per arm.

Needs ../shared/data/gsm8k/test.jsonl (beside the repository); exits cleanly when it is absent.

    python bench/bench_trace.py [--problems 64] [--repeats 3] [--batch 16] [--reduce-jobs 16]
                                [--reduce-tokens 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
sys.path.insert(0, str(ROOT))


# -- other load on the machine ------------------------------------------------------------------

HZ = os.sysconf("SC_CLK_TCK")


def busy_ticks() -> int:
    """Ticks the whole machine spent busy (not idle, not waiting on I/O), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def our_ticks() -> int:
    """CPU ticks of this process and its descendants (the stack: Redis, API, workers)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        rest = raw[raw.rindex(")") + 2 :].split()
        parents[int(entry)], ticks[int(entry)] = int(rest[1]), int(rest[11]) + int(rest[12])
    ours, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in ours]
        ours.update(children)
        frontier += children
    return sum(ticks.get(pid, 0) for pid in ours)


class Others:
    """CPU used by processes that are not this benchmark's, in cores, over a `with` block
    (other tests on the machine compete for its cores: this makes that contention visible)."""

    cores = 0.0

    def __enter__(self) -> Others:
        self.t0, self.busy0, self.ours0 = time.perf_counter(), busy_ticks(), our_ticks()
        return self

    def __exit__(self, *_: object) -> None:
        elapsed = time.perf_counter() - self.t0
        others = (busy_ticks() - self.busy0) - (our_ticks() - self.ours0)
        self.cores = max(0.0, others / HZ / elapsed)


def wait_quiet(most_seconds: float, threshold: float = 0.2) -> float:
    """Wait (up to `most_seconds`) until other processes use under `threshold` cores over a
    second; returns the seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < most_seconds:
        with Others() as sample:
            time.sleep(1.0)
        if sample.cores < threshold:
            break
    return time.perf_counter() - started


# -- the Hugging Face baseline ------------------------------------------------------------------


class Hooks:
    """Forward hooks on the given modules copying each text's own rows (the last `lengths[b]`
    positions of row b, left padding dropped) to CPU float16, as the worker's capture does."""

    def __init__(self, model: Any, paths: list[str]) -> None:
        self.lengths: list[int] = []
        self.kept: list[list[Any]] = []  # per pass, the copied tensors
        self.handles = [model.get_submodule(path).register_forward_hook(self._hook) for path in paths]

    def _hook(self, _module: Any, _args: Any, output: Any) -> None:
        import torch

        value = output if isinstance(output, torch.Tensor) else output[0]
        self.kept[-1] += [
            value[b, value.shape[1] - n :].to(device="cpu", dtype=torch.float16, copy=True)
            for b, n in enumerate(self.lengths)
        ]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def hf_one_at_a_time(model: Any, hooks: Hooks, texts: list[list[int]]) -> float:
    import torch

    hooks.kept = []
    started = time.perf_counter()
    with torch.inference_mode():
        for ids in texts:
            hooks.lengths, hooks.kept = [len(ids)], [*hooks.kept, []]
            model(torch.tensor([ids]), logits_to_keep=1, use_cache=False)
    return time.perf_counter() - started


def hf_batched(model: Any, hooks: Hooks, texts: list[list[int]], batch: int, pad_id: int) -> float:
    """Left-padded passes of `batch` texts in submission order (the worker takes them in so)."""
    import torch

    hooks.kept = []
    started = time.perf_counter()
    with torch.inference_mode():
        for at in range(0, len(texts), batch):
            group = texts[at : at + batch]
            width = max(len(ids) for ids in group)
            ids = torch.tensor([[pad_id] * (width - len(t)) + t for t in group])
            mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in group])
            inputs: dict[str, Any] = {"input_ids": ids}
            if min(len(t) for t in group) < width:  # as Decoder.trace: no mask when nothing is padded
                inputs["attention_mask"] = mask
                inputs["position_ids"] = (mask.cumsum(dim=1) - 1).clamp(min=0)
            hooks.lengths, hooks.kept = [len(t) for t in group], [*hooks.kept, []]
            model(**inputs, logits_to_keep=1, use_cache=False)
    return time.perf_counter() - started


# -- through the API ----------------------------------------------------------------------------


def when(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def run_jobs(base_url: str, requests: list[dict]) -> tuple[float, list[Any]]:
    """Submit all at once, wait for all: (seconds, the finished jobs)."""
    from shared.client import Client

    with Client(base_url, timeout=600) as client:
        started = time.perf_counter()
        jobs = client.submit_many(requests, batch_size=len(requests))
        done = [job.wait(timeout=3600) for job in jobs]  # raises JobFailed on any failure
        return time.perf_counter() - started, done


def job_seconds(job: Any) -> float:
    return when(job.data["finished_at"]) - when(job.data["started_at"])


def worker_span(jobs: list[Any]) -> float:
    """First job started to last job finished, from the records."""
    return max(when(j.data["finished_at"]) for j in jobs) - min(when(j.data["started_at"]) for j in jobs)


def captured_bytes(job: Any) -> int:
    return sum(t["bytes"] for t in job.manifest["tensors"])


def estimates(requests: list[dict], info: Any) -> list[int]:
    """The capture bytes api/submit_checks.py `plan` estimates for each request."""
    from shared import capture_spec
    from shared.schemas import JobRequest

    out = []
    for body in requests:
        request = JobRequest.model_validate(body)
        assert request.capture is not None
        points = capture_spec.resolve(request.capture, info)
        out.append(capture_spec.estimate(request, points, info, 0).capture)
    return out


def ratio_stats(estimated: list[int], jobs: list[Any]) -> dict[str, float]:
    ratios = [e / captured_bytes(j) for e, j in zip(estimated, jobs, strict=True)]
    return {"max": max(ratios), "median": statistics.median(ratios), "min": min(ratios)}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=64, help="gold solutions traced per throughput arm")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per arm (the median is reported)")
    parser.add_argument("--batch", type=int, default=16, help="ACTQ_MAX_BATCH of the batched arms (and HF's batch)")
    parser.add_argument("--reduce-jobs", type=int, default=16, help="jobs per reduce arm")
    parser.add_argument("--reduce-tokens", type=int, default=200, help="about this many tokens per reduce job")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=15,
        help="before each timed run, wait up to this many seconds for other processes to leave the cores idle",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} is absent (the GSM8K test split beside the repository)")
        return 0

    import redis
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.cli.gsm8k import data as gsm8k
    from shared.cli.gsm8k.scoring import fewshot_answer
    from shared.cli.local_stack import Stack
    from shared.cli.redis_server import RedisServer
    from shared.client import Client
    from shared.registry import ModelRegistry
    from shared.settings import Settings
    from worker.model.loading import resolve_source

    load_start = os.getloadavg()
    results: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "loadavg_start": load_start}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)} ({os.cpu_count()} cores)", flush=True)

    def trace_messages(problem: Any) -> list[dict[str, str]]:
        return [*gsm8k.messages(problem, "zero-shot"), {"role": "assistant", "content": fewshot_answer(problem.answer)}]

    def trace_requests(model: str, chosen: list[Any], capture: dict) -> list[dict]:
        """One trace job per problem over its gold solution (what `actq gsm8k --capture-on gold` sends)."""
        return [
            {"model": model, "mode": "trace", "messages": trace_messages(p), "capture": capture, "logprobs": False}
            for p in chosen
        ]

    all_problems = gsm8k.load(str(DATA))
    problems = all_problems[: args.problems]
    settings = Settings()
    source = resolve_source(settings)
    threads = settings.torch_threads or torch.get_num_threads()  # the worker: ACTQ_TORCH_THREADS, else torch's
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=True).eval()
    n_layers = int(model.config.num_hidden_layers)
    layers = [n_layers // 4, n_layers // 2, 3 * n_layers // 4]

    def tokens(messages: list[dict[str, str]]) -> list[int]:
        encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=False, return_dict=True)
        return [int(i) for i in encoded["input_ids"]]

    texts = [tokens(trace_messages(p)) for p in problems]
    lengths = [len(t) for t in texts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    print(
        f"{len(texts)} traces, {sum(lengths)} tokens (min {min(lengths)}, median {statistics.median(lengths):.0f}, "
        f"max {max(lengths)}); layers {layers} of {n_layers}; torch threads {threads}",
        flush=True,
    )
    # The reduce arms: the gold solutions whose trace is closest to --reduce-tokens tokens.
    every = {p.index: len(tokens(trace_messages(p))) for p in all_problems}
    by_distance = sorted(all_problems, key=lambda p: (abs(every[p.index] - args.reduce_tokens), p.index))
    reduce_problems = sorted(by_distance[: args.reduce_jobs], key=lambda p: p.index)
    reduce_lengths = [every[p.index] for p in reduce_problems]

    # 1. the HF baseline, before any stack runs
    hooks = Hooks(model, [f"model.layers.{i}" for i in layers])
    hf_one_at_a_time(model, hooks, texts[:2])  # warm up (the worker does a dry run at start)
    hf_batched(model, hooks, texts[: args.batch], args.batch, pad_id)
    hf_runs: dict[str, list[float]] = {"hf_one": [], "hf_batched": []}
    hf_others: dict[str, list[float]] = {"hf_one": [], "hf_batched": []}
    reference: list[Any] = []  # text 0's captures at one at a time, to compare with actq's
    for _ in range(args.repeats):
        for key in hf_runs:
            waited = wait_quiet(args.quiet_wait)
            with Others() as others:
                if key == "hf_one":
                    seconds = hf_one_at_a_time(model, hooks, texts)
                    reference = hooks.kept[0]
                else:
                    seconds = hf_batched(model, hooks, texts, args.batch, pad_id)
            hf_runs[key].append(seconds)
            hf_others[key].append(others.cores)
            print(
                f"{key:10}: {seconds:6.2f} s (waited {waited:.0f} s for quiet; others used {others.cores:.2f} cores)",
                flush=True,
            )
    hooks.close()
    del model

    # 1.-3. through the API
    capture3 = {"preset": "residual", "layers": layers, "positions": "all", "dtype": "float16"}
    arms: dict[str, dict[str, Any]] = {}
    for name, times in hf_runs.items():
        arms[name] = {
            "seconds": statistics.median(times),
            "all_seconds": times,
            "others_cores": statistics.median(hf_others[name]),
            "all_others_cores": hf_others[name],
        }
    reduce_arms: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="actq-bench-trace-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        env = {"ACTQ_REDIS_URL": server.url, "ACTQ_STORAGE_URL": Path(tmp, "data").as_uri()}
        registry = ModelRegistry(redis.Redis.from_url(server.url), heartbeat_ttl=60)
        with Stack(Path(tmp), env) as stack:
            stack.start_api()
            for batch in (1, args.batch):
                model_name = f"bench-trace-b{batch}"
                started = time.perf_counter()
                stack.start_worker(
                    model_name, {"ACTQ_MAX_BATCH": str(batch), "ACTQ_MODEL_NAME": model_name}, timeout=900
                )
                print(f"worker {model_name} up in {time.perf_counter() - started:.1f} s", flush=True)
                with Client(stack.base_url) as client:
                    listed = next(m for m in client.models() if m["name"] == model_name)
                preset = listed["presets"]["residual"]
                assert len(preset) == n_layers and all(preset[i] == f"model.layers.{i}" for i in layers), preset
                info = registry.get(model_name)
                assert info is not None
                requests = trace_requests(model_name, problems, capture3)
                estimated = estimates(requests, info)
                runs: list[float] = []
                spans: list[float] = []
                contention: list[float] = []
                jobs: list[Any] = []
                for repeat in range(args.repeats):
                    waited = wait_quiet(args.quiet_wait)
                    with Others() as others:
                        seconds, jobs = run_jobs(stack.base_url, requests)
                    runs.append(seconds)
                    spans.append(worker_span(jobs))
                    contention.append(others.cores)
                    print(
                        f"actq batch {batch:>2}: {seconds:6.2f} s (worker span {spans[-1]:6.2f} s; waited {waited:.0f} s "
                        f"for quiet; others used {others.cores:.2f} cores)",
                        flush=True,
                    )
                    if repeat == 0:  # the worker's tokens and text 0's capture against the baseline's
                        with Client(stack.base_url) as client:
                            mismatched = sum(
                                client.job(j.id).tensor("token_ids").tolist() != ids
                                for j, ids in zip(jobs, texts, strict=True)
                            )
                            files = client.job(jobs[0].id).activations()
                        got = [files[f"model.layers.{i}"] for i in layers]
                        diff = max(
                            float((g.float() - r.float()).abs().max()) for g, r in zip(got, reference, strict=True)
                        )
                        print(
                            f"  token ids differing from this process's: {mismatched}; text 0 vs HF one at a time: max abs diff {diff:.3g}"
                        )
                arms[f"actq_b{batch}"] = {
                    "max_batch": batch,
                    "seconds": statistics.median(runs),
                    "all_seconds": runs,
                    "others_cores": statistics.median(contention),
                    "all_others_cores": contention,
                    "worker_span_seconds": statistics.median(spans),
                    "median_job_seconds": statistics.median(job_seconds(j) for j in jobs),
                    "token_id_mismatches": mismatched,
                    "text0_max_abs_diff_vs_hf": diff,
                    "estimate_over_actual": ratio_stats(estimated, jobs),
                    "file_bytes_median": statistics.median(j.manifest["bytes"] for j in jobs),
                }
                if batch == args.batch:  # 2. reduce none vs mean, on the batched worker
                    first: dict[str, list[Any]] = {}
                    for reduce in ("none", "mean"):
                        capture = {"preset": "residual", "positions": "all", "dtype": "float32", "reduce": reduce}
                        requests = trace_requests(model_name, reduce_problems, capture)
                        estimated = estimates(requests, info)
                        runs, per_job, all_jobs, contention = [], [], [], []
                        for repeat in range(args.repeats):
                            waited = wait_quiet(args.quiet_wait)
                            with Others() as others:
                                seconds, jobs = run_jobs(stack.base_url, requests)
                            runs.append(seconds)
                            contention.append(others.cores)
                            per_job += [job_seconds(j) for j in jobs]
                            all_jobs += jobs
                            if repeat == 0:
                                first[reduce] = jobs
                            print(
                                f"reduce {reduce}: {seconds:6.2f} s (waited {waited:.0f} s for quiet; others used "
                                f"{others.cores:.2f} cores)",
                                flush=True,
                            )
                        reduce_arms[reduce] = {
                            "seconds": statistics.median(runs),
                            "all_seconds": runs,
                            "others_cores": statistics.median(contention),
                            "median_job_seconds": statistics.median(per_job),
                            "file_bytes_median": statistics.median(j.manifest["bytes"] for j in all_jobs),
                            "captured_bytes_median": statistics.median(captured_bytes(j) for j in all_jobs),
                            "estimate_over_actual": ratio_stats(estimated * args.repeats, all_jobs),
                        }
                    worst_abs = worst_rel = 0.0
                    with Client(stack.base_url) as client:
                        for plain_job, mean_job in zip(first["none"], first["mean"], strict=True):
                            plain = client.job(plain_job.id).activations()
                            mean = client.job(mean_job.id).activations()
                            names = [t["name"] for t in mean_job.manifest["tensors"]]
                            assert (
                                names == [t["name"] for t in plain_job.manifest["tensors"]] and len(names) == n_layers
                            )
                            for tensor in names:
                                want = plain[tensor].double().mean(dim=0, keepdim=True)
                                reduced = mean[tensor].double().reshape(want.shape)
                                err = float((reduced - want).abs().max())
                                worst_abs = max(worst_abs, err)
                                worst_rel = max(worst_rel, err / float(want.abs().max()))
                    reduce_arms["check"] = {"max_abs_diff": worst_abs, "max_rel_diff": worst_rel}
                    print(
                        f"mean file vs mean over rows of the none file: max abs diff {worst_abs:.3g}, max relative (to the tensor's largest value) {worst_rel:.3g}",
                        flush=True,
                    )
                stack.stop_process(f"worker-{model_name}")

    load_end = os.getloadavg()
    n = len(texts)
    for arm in arms.values():
        arm["texts_per_second"] = n / arm["seconds"]
    tps = {k: a["texts_per_second"] for k, a in arms.items()}
    b = f"actq_b{args.batch}"
    ratios = {
        "actq_b1 / hf_one (target >= 0.85)": tps["actq_b1"] / tps["hf_one"],
        f"{b} / hf_one": tps[b] / tps["hf_one"],
        f"{b} / hf_batched": tps[b] / tps["hf_batched"],
    }
    results.update(
        arms=arms,
        ratios=ratios,
        reduce=reduce_arms,
        texts=n,
        tokens=sum(lengths),
        layers=layers,
        torch_threads=threads,
        reduce_tokens=reduce_lengths,
        loadavg_end=load_end,
    )

    print(f"\ncommand: {results['command']}")
    print(
        f"load average: start {' '.join(f'{x:.2f}' for x in load_start)}, end {' '.join(f'{x:.2f}' for x in load_end)} ({os.cpu_count()} cores)"
    )
    print(
        f"1. {n} GSM8K gold traces, {sum(lengths)} tokens (median {statistics.median(lengths):.0f}), residual layers {layers}, "
        f"all positions, float16; torch threads {threads}; medians of {args.repeats}"
    )
    print(
        "arm                        | texts/s | seconds | runs (s)              | others' cores | worker span s | job s (median) | est/actual max | median"
    )
    labels = {
        "hf_one": "HF one at a time",
        "hf_batched": f"HF batched {args.batch}",
        "actq_b1": "actq ACTQ_MAX_BATCH=1",
        b: f"actq ACTQ_MAX_BATCH={args.batch}",
    }
    for key, label in labels.items():
        arm = arms[key]
        runs_text = " ".join(f"{s:.2f}" for s in arm["all_seconds"])
        extra = (
            f"{arm['worker_span_seconds']:13.2f} | {arm['median_job_seconds']:14.3f} | "
            f"{arm['estimate_over_actual']['max']:14.2f} | {arm['estimate_over_actual']['median']:.2f}"
            if key.startswith("actq")
            else f"{'':13} | {'':14} | {'':14} |"
        )
        print(
            f"{label:26} | {arm['texts_per_second']:7.2f} | {arm['seconds']:7.2f} | {runs_text:21} | "
            f"{arm['others_cores']:13.2f} | {extra}"
        )
    for label, value in ratios.items():
        print(f"  {label}: {value:.3f}")
    print(
        f"2. reduce, {args.reduce_jobs} traces of {min(reduce_lengths)}-{max(reduce_lengths)} tokens, all {n_layers} residual "
        f"layers, all positions, float32, ACTQ_MAX_BATCH={args.batch}; medians of {args.repeats}"
    )
    print(
        "reduce | file bytes | captured bytes | job s (median) | arm wall s | others' cores | est/actual max | median"
    )
    for reduce in ("none", "mean"):
        arm = reduce_arms[reduce]
        est = arm["estimate_over_actual"]
        print(
            f"{reduce:6} | {arm['file_bytes_median']:10.0f} | {arm['captured_bytes_median']:14.0f} | "
            f"{arm['median_job_seconds']:14.3f} | {arm['seconds']:10.2f} | {arm['others_cores']:13.2f} | "
            f"{est['max']:14.2f} | {est['median']:.2f}"
        )
    size_ratio = reduce_arms["none"]["file_bytes_median"] / reduce_arms["mean"]["file_bytes_median"]
    results["reduce"]["file_size_ratio_none_over_mean"] = size_ratio
    check = reduce_arms["check"]
    print(f"  file size none / mean: {size_ratio:.1f}x")
    print(
        f"  mean file vs mean over rows of the none file: max abs diff {check['max_abs_diff']:.3g}, max relative {check['max_rel_diff']:.3g}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU table: Hugging Face `generate` beside actq's engine, without and with a capture, per batch size.

The model has Qwen2-0.5B's shape (Qwen2ForCausalLM: hidden 896, 24 layers, 14 attention heads / 2
key-value heads, intermediate 4864, vocabulary 151936, tied embeddings), built from a config with
random weights, in bfloat16 on cuda, with SmolLM2's tokenizer (ids past its 49,152 decode to no
text; the text is not the point). The prompts are GSM8K questions read from --gsm8k (a JSONL file in
GSM8K's format) or made-up ones in its style (shared/cli/gsm8k/synthetic.py), each as one zero-shot
user turn; every row generates exactly --max-tokens greedy tokens (no end-of-sequence stop). Per
batch size, medians over --repeats (the arms interleaved), in generated tokens per second from the
prompts' submission to the results on the host:

  generate       HF `generate` on the batch at once, left-padded, eager
  static         HF `generate` with a static cache, compiled (`torch.compile(mode="reduce-overhead")`,
                 what transformers does for `cache_implementation="static"`): the graph-based peer (CUDA only)
  eager          the same prompts as jobs of actq's scheduler in process (no Redis, no API), each job's
                 result finished (text, tensors), its decoding steps run eagerly (ACTQ_CUDA_GRAPHS off)
  graphs         the same, decoding steps replayed as CUDA graphs (the default)
  capture        graphs, each job capturing the residual stream of every layer (the `residual` preset) at
                 generated positions, in the model's dtype (recorded inside the replayed step)
  edit           graphs, each job adding a vector at 3 layers (applied from the edit tables inside the replayed step)
  graphs/generate, graphs/static   speed ratios; capture/graphs and edit/graphs: time with / time
                 without (the cost); a ratio is printed where both its arms ran (--arms)

With --store DIR, then: the capture arm at the largest batch with every job's file written to a
LocalStore under DIR as its job ends (worker/results/artifacts.py, by --writers threads, as the worker's task
threads write them), in MB/s of captured rows reaching files, beside the same bytes written to one
file under DIR with one fsync: whether the writers keep up with the disk.

Fair arms: every arm runs once at every batch size before anything is timed (kernels, the allocator,
the CUDA graphs of every bucket the run needs); at least 3 timed repeats, interleaved across arms, the
median reported; actq's scheduler prefills all the jobs waiting in one left-padded pass, as `generate`
does (`prefill_padding=1.0`: its length grouping is a CPU economy, not the thing measured here).

    .venv/bin/python bench/bench_gpu.py [--batches 1 8 32 128] [--max-tokens 64] [--repeats 3]
                                        [--dtype bfloat16] [--gsm8k test.jsonl] [--json out.json]
                                        [--store /var/tmp/actq-bench]
    .venv/bin/python bench/bench_gpu.py --allow-cpu    # without CUDA: a smoke run; its figures mean nothing

Without CUDA, --allow-cpu runs the same code on the CPU on a tiny model of the same family (2 layers,
hidden 64, float32), at batches 1 and 2, 8 tokens, one repeat (unless told otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # shared, worker, from a checkout

ARMS = ["generate", "static", "eager", "graphs", "capture", "edit"]
QWEN2_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
}
SMOKE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
}


def build_model(folder: Path, shape: dict, dtype: str) -> Path:
    """A random-weight Qwen2 of `shape` in `folder`, with SmolLM2's tokenizer (no download)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from shared.settings import Settings
    from worker.model.loading import ensure_smollm2

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2(Settings().model_cache_dir), local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = Qwen2Config(
        **{"vocab_size": len(tokenizer), **shape},
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def chats(source: Path | None, count: int) -> list[list[dict[str, str]]]:
    """`count` zero-shot GSM8K chats: the file's questions (cycled), or synthetic ones."""
    from shared.cli.gsm8k import data

    problems = data.load(str(source)) if source is not None else data.load("synthetic")
    return [data.messages(problems[i % len(problems)], "zero-shot") for i in range(count)]


def generate_arm(served, batch: list[list[dict[str, str]]], max_tokens: int, sync: Callable[[], None], **extra):
    """(seconds, generated tokens) of one left-padded HF `generate` over the batch."""
    tokenizer, model = served.tokenizer, served.hf
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in batch]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, return_tensors="pt", padding=True).to(served.loaded.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        sync()
        started = time.perf_counter()
        out = model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, **extra
        )
        sync()
        elapsed = time.perf_counter() - started
    return elapsed, (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch)


def static_arm(served, batch: list[list[dict[str, str]]], max_tokens: int, sync: Callable[[], None]):
    """`generate_arm` with a static cache, which transformers compiles (reduce-overhead)."""
    return generate_arm(served, batch, max_tokens, sync, cache_implementation="static")


@contextmanager
def core_running(served, seqs: list, sync, each: Callable[[int, object], None]):
    """`seqs` as jobs of an engine core in process (prefilled in one pass, as `generate` does),
    `each(i, outcome)` called as job i ends; yields (the submission time, an event set once every
    job has ended). The core stops on exit (after the caller's timing: stopping waits on its inbox)."""
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    ended = [0]
    answered = threading.Event()

    def entry(i: int) -> Entry:
        def answer(outcome: object) -> None:
            each(i, outcome)
            ended[0] += 1  # the engine thread answers one job at a time
            if ended[0] == len(seqs):
                answered.set()

        return Entry(seq=seqs[i], done=answer)

    core = EngineCore(served, max_batch=len(seqs), prefill_padding=1.0)
    sync()
    started = time.perf_counter()
    for i in range(len(seqs)):
        core.submit(entry(i))
    core.start()
    try:
        yield started, answered
    finally:
        core.stop()


def engine_arm(
    served,
    batch: list[list[dict[str, str]]],
    max_tokens: int,
    capture: dict | None,
    sync,
    interventions: list[dict] | None = None,
):
    """(seconds, generated tokens) of the batch as jobs of the scheduler in process, from their
    submission to every job's finished result (its text and captured tensors on the host)."""
    from shared.capture_spec import resolve
    from shared.intervention_check import resolve as resolve_edits
    from shared.schemas import JobRequest

    body = {"model": "m", "capture": capture, "interventions": interventions}
    requests = [JobRequest.model_validate({**body, "messages": c}) for c in batch]
    spec = requests[0].capture  # the same for every job
    points = resolve(spec, served.info) if spec is not None else []
    edits = resolve_edits(requests[0].interventions, served.info, False, max_tokens) if interventions else None
    seqs = [served.prepare(request, points, max_tokens, None, edits) for request in requests]
    outcomes: dict[int, object] = {}
    with core_running(served, seqs, sync, outcomes.__setitem__) as (started, answered):
        answered.wait()
        failed = [outcome for outcome in outcomes.values() if isinstance(outcome, Exception)]
        if failed:
            raise failed[0]
        results = [served.finish(outcomes[i], request) for i, request in enumerate(requests)]
        sync()
        elapsed = time.perf_counter() - started
    if any(len(result.captured) != len(points) for result in results):
        raise RuntimeError("a job came back without its captured tensors")
    return elapsed, sum(result.completion_tokens for result in results)


def storage(served, prompts, max_tokens: int, dtype: str, sync, folder: Path, writers: int) -> dict:
    """The capture arm with its files: each job's result finished and written (worker/results/artifacts.py:
    safetensors, sha256, fsync, atomic rename, manifest) to a LocalStore in `folder` by `writers`
    threads as its job ends, as the worker's task threads do; beside it, the same number of bytes
    written to one file in 8 MiB blocks with one fsync (the disk's own sequential rate)."""
    from concurrent.futures import ThreadPoolExecutor

    from shared.capture_spec import resolve
    from shared.schemas import JobRequest
    from shared.storage import LocalStore
    from worker.results.artifacts import write_activations

    capture = {"preset": "residual", "positions": "generated", "dtype": dtype}
    requests = [JobRequest.model_validate({"model": "m", "capture": capture, "messages": c}) for c in prompts]
    points = resolve(requests[0].capture, served.info)
    seqs = [served.prepare(request, points, max_tokens) for request in requests]
    store = LocalStore(folder / "store")
    written: list[int] = []
    lock = threading.Lock()
    futures = []

    def write(i: int, outcome) -> None:
        generation = served.finish(outcome, requests[i])
        write_activations(store, f"bench-{i}", "m", requests[i].capture, generation, prefix=f"jobs/bench-{i}/attempt-1")
        with lock:
            written.append(sum(c.tensor.numel() * c.tensor.element_size() for c in generation.captured))

    with ThreadPoolExecutor(writers, thread_name_prefix="bench-writer") as pool:
        with core_running(served, seqs, sync, lambda i, o: futures.append(pool.submit(write, i, o))) as (
            started,
            answered,
        ):
            answered.wait()
            for future in futures:
                future.result()
            elapsed = time.perf_counter() - started
    total = sum(written)
    block = os.urandom(8 << 20)
    raw = folder / "sequential.bin"
    began = time.perf_counter()
    with open(raw, "wb") as out:
        for _ in range(max(1, -(-total // len(block)))):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    disk = time.perf_counter() - began
    raw.unlink()
    return {
        "jobs": len(seqs),
        "captured_bytes": total,
        "seconds": elapsed,
        "tokens_per_s": len(seqs) * max_tokens / elapsed,
        "stored_mb_per_s": total / elapsed / 1e6,
        "disk_mb_per_s": max(1, -(-total // len(block))) * len(block) / disk / 1e6,
    }


def median_rate(runs: list[tuple[float, int]]) -> float:
    return statistics.median(tokens / seconds for seconds, tokens in runs)


def table(
    engines, prompts, batches: list[int], max_tokens: int, repeats: int, dtype: str, sync, only: list[str] | None = None
) -> list[dict]:
    """Print and return one row per batch size: each arm's median tokens/s and the ratios."""
    graphs, eager = engines
    capture = {"preset": "residual", "positions": "generated", "dtype": dtype}
    layers = graphs.info.num_layers
    width = graphs.info.hidden_size
    generator = torch.Generator().manual_seed(0)
    edit = [
        {"module": f"model.layers.{layer}", "op": "add", "vector": torch.randn(width, generator=generator).tolist()}
        for layer in (layers // 4, layers // 2, 3 * layers // 4)
    ]
    arms: dict[str, Callable] = {"generate": lambda batch, n: generate_arm(graphs, batch, n, sync)}
    if torch.cuda.is_available():
        arms["static"] = lambda batch, n: static_arm(graphs, batch, n, sync)
    arms.update(
        {
            "eager": lambda batch, n: engine_arm(eager, batch, n, None, sync),
            "graphs": lambda batch, n: engine_arm(graphs, batch, n, None, sync),
            "capture": lambda batch, n: engine_arm(graphs, batch, n, capture, sync),
            "edit": lambda batch, n: engine_arm(graphs, batch, n, None, sync, edit),
        }
    )
    if only:
        arms = {arm: run for arm, run in arms.items() if arm in only}
    for size in batches:  # warm-up: every arm at every shape it will be timed at
        for warm in arms.values():
            warm(prompts[:size], max_tokens)
    # name: (faster arm, slower arm); speed ratios, and for capture and edit the time with / without
    ratios = {
        "graphs/generate": ("graphs", "generate"),
        "graphs/static": ("graphs", "static"),
        "capture/graphs": ("graphs", "capture"),
        "edit/graphs": ("graphs", "edit"),
    }
    ratios = {name: pair for name, pair in ratios.items() if all(arm in arms for arm in pair)}
    print(f"{'batch':>6}" + "".join(f"{arm + ' tok/s':>15}" for arm in arms) + "".join(f"{r:>17}" for r in ratios))
    rows = []
    for size in batches:
        runs: dict[str, list[tuple[float, int]]] = {arm: [] for arm in arms}
        for _ in range(repeats):
            for arm, run in arms.items():  # interleaved: drift hits every arm alike
                runs[arm].append(run(prompts[:size], max_tokens))
        rate = {arm: median_rate(arm_runs) for arm, arm_runs in runs.items()}
        ratio = {name: rate[a] / rate[b] for name, (a, b) in ratios.items()}
        rows.append({"batch": size, **rate, **ratio, "runs": runs})
        print(
            f"{size:>6}"
            + "".join(f"{rate[arm]:>15.1f}" for arm in arms)
            + "".join(f"{v:>17.2f}" for v in ratio.values()),
            flush=True,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 8 32 128 (smoke: 1 2)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per row; default 64 (smoke: 8)")
    parser.add_argument("--repeats", type=int, help="runs per arm and batch, the median reported; default 3 (smoke: 1)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bfloat16 (smoke: float32)")
    parser.add_argument("--gsm8k", type=Path, help="a GSM8K JSONL file to take the questions from (else synthetic)")
    parser.add_argument("--json", type=Path, help="also write the table and every run here")
    parser.add_argument("--arms", nargs="+", choices=ARMS, help="only these arms (default all; the ratios need theirs)")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, a smoke run on the CPU (tiny model)")
    parser.add_argument(
        "--store",
        type=Path,
        help="also run the capture arm at the largest batch with its files written to a store here "
        "(e.g. the disk the worker writes to), beside the disk's own sequential write rate",
    )
    parser.add_argument("--writers", type=int, default=32, help="threads writing files with --store (default 32)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("bench_gpu.py needs CUDA (or --allow-cpu for a smoke run)", file=sys.stderr)
        return 2
    smoke = not cuda
    batches = args.batches or ([1, 2] if smoke else [1, 8, 32, 128])
    max_tokens = args.max_tokens or (8 if smoke else 64)
    repeats = args.repeats or (1 if smoke else 3)
    dtype = args.dtype or ("float32" if smoke else "bfloat16")
    device = "cpu" if smoke else "cuda"
    if smoke:
        torch.set_num_threads(1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    shape = SMOKE if smoke else QWEN2_05B
    with tempfile.TemporaryDirectory(prefix="actq-bench-gpu-") as tmp:
        folder = build_model(Path(tmp) / "model", shape, dtype)
        served = ServedModel(load(Settings(model=str(folder), model_name="m", device=device, dtype=dtype)))
        served.hf.generation_config.eos_token_id = None  # a random model: every row generates max_tokens
        eager = ServedModel(served.loaded, cuda_graphs=False)  # the same weights, steps run eagerly
        name = torch.cuda.get_device_name() if cuda else "CPU (smoke run: the figures mean nothing)"
        parameters = sum(p.numel() for p in served.hf.parameters())
        print(f"command: {' '.join([sys.executable, *sys.argv])}")
        print(
            f"device: {name}; {dtype}; model: {'tiny Qwen2' if smoke else 'Qwen2-0.5B shape'}, random weights, "
            f"{parameters / 1e6:.1f}M parameters; {max_tokens} greedy new tokens a row; "
            f"prompts: {args.gsm8k or 'synthetic GSM8K-style'}; capture: the residual stream of "
            f"{len(served.info.presets['residual'])} layers at generated positions; medians of {repeats}",
            flush=True,
        )
        print(f"decoding: {served.describe_decoder()}", flush=True)
        rows = table(
            (served, eager), chats(args.gsm8k, max(batches)), batches, max_tokens, repeats, dtype, sync, args.arms
        )
        stored = []
        if args.store is not None:
            args.store.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=args.store, prefix="actq-bench-store-") as where:
                prompts = chats(args.gsm8k, max(batches))[: max(batches)]
                for _ in range(repeats):
                    stored.append(storage(served, prompts, max_tokens, dtype, sync, Path(where), args.writers))
            best = sorted(stored, key=lambda run: run["stored_mb_per_s"])[len(stored) // 2]  # the median run
            print(
                f"capture to storage at batch {best['jobs']} ({args.store}, {args.writers} writers): "
                f"{best['captured_bytes'] / 1e6:.1f} MB of captured rows in {best['seconds']:.2f} s, "
                f"{best['stored_mb_per_s']:.1f} MB/s reaching files ({best['tokens_per_s']:.0f} tok/s decoded and "
                f"written); the disk alone, sequential write + fsync: {best['disk_mb_per_s']:.1f} MB/s",
                flush=True,
            )
    if args.json:
        report = {"device": name, "dtype": dtype, "shape": shape, "max_tokens": max_tokens, "rows": rows}
        report["storage"] = stored
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

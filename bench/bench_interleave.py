"""A long trace beside a running generation: chunked prefill against one long pass.

A generation job (`--max-tokens` greedy tokens of a short GSM8K-style prompt) is running in the
engine when a trace job of about `--trace-tokens` tokens arrives (its text: GSM8K-style problems
repeated; logprobs off, one residual layer captured at every position). Arms, in process (the
scheduler and decoder a worker runs, no Redis), side by side in one run:

  alone       the generation job alone
  chunked     beside the trace, ACTQ_PREFILL_CHUNK_TOKENS=`--chunk` (the default 512)
  one pass    beside the trace fed in one forward pass (chunking off: what actq did before)

Per arm, the generation job's latency (its submission to its answer) and the trace's (its
submission to its answer), medians over `--repeats`. The figure the issue asks for: the
generation's latency beside the trace stays near its latency alone, far under its 20 s limit.

    .venv/bin/python bench/bench_interleave.py [--trace-tokens 8000] [--max-tokens 32] [--repeats 3]
                                              [--model smollm2-135m] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # from a checkout

PROBLEM = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? "
)


def trace_text(served, tokens: int) -> list[dict[str, str]]:
    """A user turn and an assistant turn of about `tokens` tokens in all."""
    each = len(served.tokenizer(PROBLEM)["input_ids"])
    body = PROBLEM * max(1, tokens // each - 1)
    return [{"role": "user", "content": body}, {"role": "assistant", "content": "72"}]


def run_arm(served, chunk: int | None, max_tokens: int, trace_tokens: int | None) -> dict[str, float]:
    """Start the generation; once it decodes, submit the trace (if any); wait for both."""
    from shared.capture_spec import resolve
    from shared.schemas import JobRequest
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    answered: dict[str, float] = {}
    done = threading.Event()
    expected = 1 if trace_tokens is None else 2

    def answer(name: str, started: float):
        def record(outcome: object) -> None:
            if isinstance(outcome, Exception):
                raise SystemExit(f"the {name} job failed: {outcome!r}")
            answered[name] = time.perf_counter() - started
            if len({"generation", "trace"} & answered.keys()) == expected:
                done.set()

        return record

    core = EngineCore(served, max_batch=4, chunk_tokens=chunk).start()
    try:
        request = JobRequest(model="m", messages=[{"role": "user", "content": PROBLEM}], max_tokens=max_tokens)
        generation = served.prepare(request, [], max_tokens)
        started = time.perf_counter()
        core.submit(Entry(seq=generation, done=answer("generation", started)))
        if trace_tokens is not None:
            while not generation.generated:  # the generation is decoding
                time.sleep(0.001)
            capture = {"modules": ["model.layers.1"], "positions": "all", "dtype": "float16"}
            body = {"model": "m", "mode": "trace", "messages": trace_text(served, trace_tokens), "capture": capture}
            trace = JobRequest.model_validate(body)
            seq = served.prepare(trace, resolve(trace.capture, served.info), 0)
            answered["trace_tokens"] = seq.prompt_tokens
            core.submit(Entry(seq=seq, done=answer("trace", time.perf_counter())))
        if not done.wait(1800):
            raise SystemExit("the jobs did not finish in 30 minutes")
    finally:
        core.stop()
    return answered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trace-tokens", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    served = ServedModel(load(Settings(model=args.model, model_name="m")))
    served.hf.generation_config.eos_token_id = None  # every arm generates exactly max_tokens
    arms = {"alone": (None, None), "chunked": (args.chunk, args.trace_tokens), "one pass": (None, args.trace_tokens)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, (chunk, trace_tokens) in arms.items():
            results[name].append(run_arm(served, chunk, args.max_tokens, trace_tokens))
    table = {}
    print(
        f"model {args.model}, {args.max_tokens} generated tokens, trace ~{args.trace_tokens} tokens, torch threads {torch.get_num_threads()}"
    )
    print(f"{'arm':10} {'generation s':>13} {'trace s':>9}")
    for name, runs in results.items():
        generation = statistics.median(r["generation"] for r in runs)
        trace = statistics.median(r["trace"] for r in runs) if "trace" in runs[0] else None
        table[name] = {"generation_s": generation, "trace_s": trace, "trace_tokens": runs[0].get("trace_tokens")}
        print(f"{name:10} {generation:13.2f} {trace if trace is not None else float('nan'):9.2f}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

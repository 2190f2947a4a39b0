"""Batched decoding of recurrent and hybrid models: 8 jobs together (each job's recurrent state in
a slot, worker/batch/state_decoding.py) against the same 8 jobs one at a time, on tiny random models
(Mamba and Jamba of tests/support/architectures.py, SmolLM2's tokenizer; `--models` takes any of
its recurrent and hybrid keys, and its sliding-window ones: Mistral, Gemma 2 and 3), in this
process, side by side in one run. A sliding-window model decodes together in slots (its window in
the step's mask); it gets a third arm, the same jobs together in the compacted batch that served
it before (worker/batch/decoding.py), and is held to 1e-4 rather than 1e-5 (its attention sums over
masked positions too).

Each arm runs the same `--jobs` greedy jobs (different prompts, `--max-tokens` each) through the
engine thread (worker/engine/core.py): "together" with ACTQ_MAX_BATCH = the job count, "one at a
time" with ACTQ_MAX_BATCH = 1. Reported per model: generated tokens/s of each arm (medians over
`--repeats`), their ratio, and each row's exactness against its solo run: tokens identical, and
max |together - solo| / max |solo| over the captured residual stream of every block (all positions).

    python bench/bench_hybrid_batching.py [--models mamba,jamba] [--jobs 8] [--max-tokens 32]
                                          [--repeats 3] [--json out.json]
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
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is 2+3? Think step by step, then answer.",
    "Name three colours.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Say something about the sea.",
    "Count to five, slowly.",
    "Why is the sky blue? Answer in one sentence.",
    "Write a haiku about autumn leaves falling on a quiet pond.",
    "List the planets.",
]


def run_arm(served, requests, points, max_tokens: int, batch: int) -> tuple[float, list, int]:
    """Every job submitted at once to an engine thread batching up to `batch`: (seconds, the ended
    sequences in request order, the largest batch a step ran)."""
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        def done(outcome: object) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(requests):
                finished.set()

        return Entry(seq=served.prepare(requests[i], points, max_tokens), done=done)

    core = EngineCore(served, max_batch=batch, wait_s=0.0)
    for i in range(len(requests)):
        core.submit(entry(i))
    started = time.perf_counter()
    core.start()
    try:
        if not finished.wait(1800):
            raise SystemExit("the engine thread did not answer every job")
    finally:
        core.stop()
    seconds = time.perf_counter() - started
    return seconds, [outcomes[i] for i in range(len(requests))], core.stats.largest


def bench_model(key: str, folder: Path, jobs: int, max_tokens: int, repeats: int) -> dict:
    from shared.capture_spec import resolve
    from shared.schemas import JobRequest
    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    served = ServedModel(load(Settings(model=str(folder), model_name=key)))
    blocks = served.info.presets["residual"]
    requests = [
        JobRequest.model_validate(
            {
                "model": key,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "capture": {"modules": blocks, "positions": "all", "dtype": "float32"},
            }
        )
        for i in range(jobs)
    ]
    capture = requests[0].capture
    assert capture is not None
    points = resolve(capture, served.info)
    arms: dict[str, list[float]] = {"together": [], "one at a time": []}
    if served.slides:
        arms["compacted"] = []
    results: dict[str, list] = {}
    largest = 0
    for _ in range(repeats):
        for name in arms:
            batch = 1 if name == "one at a time" else jobs
            served.slot_reason = "the bench's compacted arm" if name == "compacted" else None
            seconds, ended, most = run_arm(served, requests, points, max_tokens, batch)
            served.slot_reason = None
            largest = max(largest, most) if batch > 1 else largest
            tokens = sum(len(seq.generated) for seq in ended)
            arms[name].append(tokens / seconds)
            results[name] = [served.finish(seq, req) for seq, req in zip(ended, requests, strict=True)]
    rows = []
    for together, alone in zip(results["together"], results["one at a time"], strict=True):
        worst = 0.0
        for got, want in zip(together.captured, alone.captured, strict=True):
            scale = float(want.tensor.abs().max()) or 1.0
            worst = max(worst, float((got.tensor - want.tensor).abs().max()) / scale)
        rows.append({"tokens_equal": bool(together.token_ids.equal(alone.token_ids)), "max_rel_diff": worst})
    medians = {name: statistics.median(values) for name, values in arms.items()}
    return {
        "model": key,
        "decodes": served.describe_decoder(),
        "tokens_per_s": medians,
        "ratio": medians["together"] / medians["one at a time"],
        "vs_compacted": medians["together"] / medians["compacted"] if "compacted" in medians else None,
        "tolerance": 1e-4 if served.slides else 1e-5,
        "largest_batch": largest,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mamba,jamba")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from shared.settings import Settings
    from tests.support.architectures import BY_KEY, build
    from worker.model.loading import ensure_smollm2

    smol = ensure_smollm2(Settings().model_cache_dir)
    report: dict = {"command": " ".join([sys.executable, *sys.argv]), "models": []}
    with tempfile.TemporaryDirectory(prefix="actq-bench-hybrid-") as tmp:
        for key in args.models.split(","):
            folder = build(BY_KEY[key], Path(tmp) / key, smol)
            report["models"].append(bench_model(key, folder, args.jobs, args.max_tokens, args.repeats))
    print(f"{args.jobs} jobs x {args.max_tokens} tokens, medians of {args.repeats}")
    print(
        f"{'model':<16} {'together tok/s':>15} {'one at a time tok/s':>20} {'together/one':>13} {'largest batch':>14}"
    )
    for entry in report["models"]:
        t = entry["tokens_per_s"]
        figures = f"{t['together']:>15.1f} {t['one at a time']:>20.1f} {entry['ratio']:>13.2f}"
        compacted = ""
        if entry["vs_compacted"] is not None:
            compacted = f"  (compacted batch {t['compacted']:.1f} tok/s: slots {entry['vs_compacted']:.2f}x)"
        print(f"{entry['model']:<16} {figures} {entry['largest_batch']:>14}{compacted}")
    print("exactness of each row together vs its solo run (tokens identical; max |diff| / max |solo|):")
    for entry in report["models"]:
        cells = [f"{'=' if r['tokens_equal'] else 'DIFF'} {r['max_rel_diff']:.1e}" for r in entry["rows"]]
        print(f"{entry['model']:<16} " + "  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    exact = all(r["tokens_equal"] and r["max_rel_diff"] <= e["tolerance"] for e in report["models"] for r in e["rows"])
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())

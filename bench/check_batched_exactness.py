"""Is a batched job's result its own? GSM8K problems run twice on the built-in model in float32,
in this process: each alone (a batch of one, which tests/worker/test_engine.py checks bit for bit
against `generate` with forward hooks), then all through the scheduler at once (iteration-level
batches of `--batch`). Reported: how many greedy completions are identical (target: at least
99%), every mismatch with its first differing step, and the distribution of
max |batched - solo| / max |solo| over every captured tensor of the identical ones (target: at
most 1e-4), for the residual capture at three layers, all positions.

    python bench/check_batched_exactness.py [--problems 200] [--max-tokens 128] [--batch 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} is absent (the GSM8K test split beside the repository)")
        return 0
    import torch

    from shared.capture_spec import resolve
    from shared.cli.gsm8k import data as gsm8k
    from shared.schemas import CaptureSpec, JobRequest
    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry
    from worker.model.loading import load

    served = ServedModel(load(Settings(dtype="float32")))
    info = served.info.model_dump()
    capture = gsm8k.residual_capture(info, positions="all", dtype="float32")
    problems = gsm8k.load(str(DATA))[: args.problems]
    requests = [
        JobRequest(model=served.info.name, messages=gsm8k.messages(p, "zero-shot"), capture=CaptureSpec(**capture))
        for p in problems
    ]
    points = resolve(requests[0].capture, served.info)

    started = time.perf_counter()
    alone = [served.run(r, points, args.max_tokens) for r in requests]
    solo_seconds = time.perf_counter() - started
    print(f"solo: {len(alone)} problems in {solo_seconds:.0f} s", flush=True)

    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        def done(outcome: object) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(requests):
                finished.set()

        return Entry(seq=served.prepare(requests[i], points, args.max_tokens), done=done)

    core = EngineCore(served, max_batch=args.batch)
    for i in range(len(requests)):
        core.submit(entry(i))
    started = time.perf_counter()
    core.start()
    finished.wait()
    batched_seconds = time.perf_counter() - started
    core.stop()
    batched = [served.finish(outcomes[i], r) for i, r in enumerate(requests)]  # type: ignore[arg-type]

    mismatches, ratios, shape_errors = [], [], []
    for i, (b, a) in enumerate(zip(batched, alone, strict=True)):
        if not torch.equal(b.token_ids, a.token_ids):
            n = min(len(b.token_ids), len(a.token_ids))
            diff = (b.token_ids[:n] != a.token_ids[:n]).nonzero()
            first = int(diff[0]) if len(diff) else n
            mismatches.append({"problem": problems[i].index, "first_differing_step": first - a.prompt_tokens})
            continue
        for got, want in zip(b.captured, a.captured, strict=True):
            if got.tensor.shape != want.tensor.shape:  # a padding row or another job's rows kept
                shape_errors.append({"problem": problems[i].index, "got": list(got.tensor.shape)})
                continue
            ratios.append(float((got.tensor - want.tensor).abs().max()) / float(want.tensor.abs().max()))
    identical = len(requests) - len(mismatches)
    ratios.sort()
    quantile = lambda q: ratios[min(len(ratios) - 1, int(q * len(ratios)))] if ratios else float("nan")  # noqa: E731
    results = {
        "command": " ".join([sys.executable, *sys.argv]),
        "problems": len(requests),
        "identical": identical,
        "identical_share": identical / len(requests),
        "mismatches": mismatches,
        "tensors_compared": len(ratios),
        "shape_errors": shape_errors,
        "relative_diff": {
            "median": statistics.median(ratios) if ratios else None,
            "p90": quantile(0.90),
            "p99": quantile(0.99),
            "max": ratios[-1] if ratios else None,
            "share_zero": sum(r == 0 for r in ratios) / len(ratios) if ratios else None,
        },
        "solo_seconds": solo_seconds,
        "batched_seconds": batched_seconds,
        "largest_batch": core.stats.largest,
    }
    print(json.dumps(results, indent=2))
    verdict = identical / len(requests) >= 0.99 and not shape_errors and (not ratios or ratios[-1] <= 1e-4)
    print(f"identical completions {identical}/{len(requests)}; max relative diff {results['relative_diff']['max']}")
    print("PASS" if verdict else "FAIL")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())

"""lm-evaluation-harness 0.4.13 (stock) against actq: a multiple_choice task of N items (default 100,
4 choices each: 4N loglikelihood requests, each an echo + 1-token job) with the built-in model,
`local-completions` at --batch_size 1 and 4, and how far its log-likelihoods are from transformers'.

Starts its own stack (embedded Redis, the API, a worker with the built-in SmolLM2) in a temp dir,
writes the synthetic task's data there (tests/e2e/lm_eval_tasks: sums and capital cities), and runs
lm-eval in this process as `lm_eval --model local-completions --model_args base_url=...,model=...
--batch_size B --tasks actq_mc --include_path tests/e2e/lm_eval_tasks` would (tokenizer_backend auto:
the server's tokenizer). The arms are interleaved over --repeats rounds; medians of wall time (the
whole simple_evaluate: lm-eval's own tokenization requests included) and the ratio batch 1 / batch B.
Then every choice's log-likelihood of every run against transformers in float32 in this process
(`tests/e2e/lm_eval_tasks/reference.py`): the largest absolute difference, is_greedy agreement, and
lm-eval's accuracy against the reference's.

    python bench/bench_lm_eval.py [--items 100] [--batch-sizes 1 4] [--repeats 3] [--text] [--json out.json]
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from shared.cli.local_stack import local_stack  # noqa: E402
from shared.settings import Settings  # noqa: E402
from tests.e2e.lm_eval_tasks import runs, synthetic  # noqa: E402


def scores(results: dict[str, Any]) -> dict[tuple[str, str], tuple[float, bool]]:
    """(context, continuation) -> lm-eval's (log-likelihood, is_greedy), over every logged sample."""
    out = {}
    for sample in results["samples"]["actq_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            out[(context, continuation)] = (float(resp[0]), bool(resp[1]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100, help="multiple-choice items (4 choices each)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--concurrent", type=int, default=0, help="also batch 1 with num_concurrent N (0: not)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", action="store_true", help="tokenized_requests=False: prompts sent as text")
    parser.add_argument(
        "--local-tokenizer", action="store_true", help="lm-eval tokenizes with the model's folder, not the server"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from worker.model.loading import ensure_smollm2

    settings = Settings()
    folder = ensure_smollm2(settings.model_cache_dir)  # the built-in model, as the worker loads it
    # arm -> (--batch_size, more --model_args)
    arms: dict[str, tuple[int, dict[str, Any]]] = {f"batch {b}": (b, {}) for b in args.batch_sizes}
    if args.concurrent:
        arms[f"batch 1, num_concurrent {args.concurrent}"] = (1, {"num_concurrent": args.concurrent})
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "items": args.items,
        "requests": args.items * 4,
        "model": settings.served_model_name,
        "tokenized_requests": not args.text,
        "tokenizer": "local folder" if args.local_tokenizer else "the server's (tokenizer_backend=auto)",
        "wall_seconds": {arm: [] for arm in arms},
    }
    runs_scores: list[dict[tuple[str, str], tuple[float, bool]]] = []
    accuracies: list[float] = []
    with tempfile.TemporaryDirectory(prefix="actq-bench-lm-eval-") as tmp:
        data_dir = synthetic.write(Path(tmp) / "data", args.items, 1)
        with local_stack(settings, 900, say=print, temporary_store=True) as stack:
            model_args: dict[str, Any] = {
                "base_url": f"{stack.base_url}/v1/completions",
                "model": settings.served_model_name,
                "tokenized_requests": not args.text,
                "max_retries": 1,
            }
            if args.local_tokenizer:
                model_args.update(tokenizer_backend="huggingface", tokenizer=str(folder))
            for batch, extra in arms.values():  # warm-up, not timed: the engine's first passes, the dataset cache
                runs.evaluate(
                    "local-completions", {**model_args, **extra}, ["actq_mc"], data_dir, batch_size=batch, limit=4
                )
            for repeat in range(args.repeats):
                for name, (batch, extra) in arms.items():
                    started = time.perf_counter()
                    _, results = runs.evaluate(
                        "local-completions", {**model_args, **extra}, ["actq_mc"], data_dir, batch_size=batch
                    )
                    wall = time.perf_counter() - started
                    report["wall_seconds"][name].append(wall)
                    runs_scores.append(scores(results))
                    accuracies.append(results["results"]["actq_mc"]["acc,none"])
                    print(f"round {repeat + 1}: {name}: {wall:.1f} s", flush=True)

    from tests.e2e.lm_eval_tasks.reference import Reference

    reference = Reference.load(folder)
    pairs = sorted(runs_scores[0])
    want = {pair: reference.loglikelihood(*pair) for pair in pairs}
    diffs = [abs(got[pair][0] - want[pair][0]) for got in runs_scores for pair in pairs]
    greedy_same = all(got[pair][1] == want[pair][1] for got in runs_scores for pair in pairs)
    items = synthetic.mc_items(args.items)  # what synthetic.write put in the data file
    right = 0
    for item in items:
        context = f"Question: {item['question']}\nAnswer:"
        values = [want[(context, " " + c)][0] for c in item["choices"]]
        right += max(range(len(values)), key=values.__getitem__) == item["answer"]
    medians = {arm: statistics.median(w) for arm, w in report["wall_seconds"].items()}
    first = next(iter(arms))
    report.update(
        median_wall_seconds=medians,
        speedup_over_first={arm: medians[first] / m for arm, m in medians.items()},
        max_abs_loglikelihood_diff=max(diffs),
        is_greedy_agrees=greedy_same,
        lm_eval_accuracy=sorted(set(accuracies)),
        reference_accuracy=right / len(items),
    )
    print(f"command: {report['command']}")
    print(f"{args.items} items x 4 choices = {report['requests']} loglikelihood requests, {settings.served_model_name}")
    print(f"tokenizer: {report['tokenizer']}; tokenized_requests={not args.text}")
    print(f"{'arm':<30} {'median s':>9} {'requests/s':>11} {'speed-up':>9}   (medians of {args.repeats})")
    for name, m in medians.items():
        print(f"{name:<30} {m:>9.1f} {report['requests'] / m:>11.1f} {medians[first] / m:>8.2f}x")
    print(
        f"log-likelihoods vs transformers (float32): max |diff| {max(diffs):.2e} over {len(diffs)} values "
        f"(distinct requests x runs); is_greedy {'agrees' if greedy_same else 'DIFFERS'}; "
        f"accuracy lm-eval {report['lm_eval_accuracy']} "
        f"vs reference {report['reference_accuracy']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if max(diffs) <= 1e-4 and greedy_same else 1


if __name__ == "__main__":
    sys.exit(main())

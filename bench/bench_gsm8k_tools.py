"""GSM8K with and without the calculator: what the with-tools loop costs and how the model uses it.

The same N problems (default 50; GSM8K's test split beside the repository, else actq's synthetic
problems) through `actq gsm8k`'s own code path, twice, on a local stack with the built-in model
(SmolLM2-135M-Instruct, whose template has no tools: the worker's fallback prompt renders them):
`--mode no-tools` (a job per problem), `--mode with-tools` (a conversation per problem, up to
--max-turns jobs, the calculator's answers fed back; the model decides whether to call) and the
same with `--tool-choice required` (its first turn must call the calculator: constrained
decoding; later turns auto). All capture the default residual preset.
Reported for each: wall time, problems per minute, turns and tool calls per problem (mean and
distribution), how the conversations ended, tool errors, calls that did not parse, generated
tokens and accuracy.

    python bench/bench_gsm8k_tools.py [--problems 50] [--max-tokens 160] [--max-turns 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


# arm -> (--mode, --tool-choice)
ARMS = {
    "no-tools": ("no-tools", "auto"),
    "with-tools": ("with-tools", "auto"),
    "with-tools-required": ("with-tools", "required"),
}


def figures(out: Path, summary: dict, wall: float) -> dict:
    """One run's figures from its summary and samples."""
    samples = [json.loads(p.read_text()) for p in sorted((out / "samples").glob("*.json"))]
    turns_recorded = [
        json.loads(line) for p in sorted((out / "trajectories").glob("*.jsonl")) for line in p.read_text().splitlines()
    ]
    turns = [s.get("turns", 1) for s in samples]
    calls = [s.get("tool_calls", 0) for s in samples]
    return {
        "problems": summary["finished"],
        "succeeded": summary["succeeded"],
        "wall_seconds": round(wall, 2),
        "problems_per_minute": round(summary["finished"] / wall * 60, 2),
        "jobs": sum(turns),
        "turns_per_problem_mean": round(sum(turns) / len(samples), 3),
        "turns_per_problem": dict(sorted(Counter(turns).items())),
        "tool_calls_per_problem_mean": round(sum(calls) / len(samples), 3),
        "tool_calls_per_problem": dict(sorted(Counter(calls).items())),
        "problems_calling_tools": sum(c > 0 for c in calls),
        "tool_errors": sum(s.get("tool_errors", 0) for s in samples),
        # what looked like a call but did not parse (its text stays in the answer)
        "unparsed_calls": sum(len(t.get("tool_call_problems") or []) for t in turns_recorded),
        "ended": (summary.get("tools") or {}).get("ended"),
        "generated_tokens": summary["generated_tokens"],
        "tokens_per_second": round(summary["generated_tokens"] / wall, 2),
        "accuracy": summary["accuracy"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from shared.cli import local_stack as stack
    from shared.cli.gsm8k.runner import run as run_gsm8k
    from shared.client import Client
    from shared.settings import Settings

    dataset = str(DATA) if DATA.exists() else "synthetic"
    settings = Settings()
    results: dict = {"command": " ".join([sys.executable, *sys.argv]), "dataset": dataset}
    with tempfile.TemporaryDirectory(prefix="actq-bench-gsm8k-tools-") as tmp:
        os.environ["ACTQ_STORAGE_URL"] = Path(tmp, "data").as_uri()
        with stack.local_stack(settings, 900, say=print) as local:
            with Client(local.base_url) as client:
                info = next(m for m in client.models() if m["name"] == settings.served_model_name)
            results["model"] = info["name"]
            results["tool_template"] = info.get("tool_template")
            for arm, (mode, choice) in ARMS.items():
                out = Path(tmp) / arm
                started = time.perf_counter()
                summary = run_gsm8k(
                    out=out,
                    dataset=dataset,
                    limit=args.problems,
                    model=info["name"],
                    max_tokens=args.max_tokens,
                    api=local.base_url,
                    quiet=True,
                    mode=mode,
                    max_turns=args.max_turns,
                    tool_choice=choice,
                )
                results[arm] = figures(out, summary, time.perf_counter() - started)
                print(f"{arm}: {json.dumps(results[arm])}")
    print(f"command: {results['command']}")
    for arm in ARMS:
        r = results[arm]
        print(
            f"  {arm:<19} {r['problems']} problems in {r['wall_seconds']:.1f} s ({r['problems_per_minute']:.1f}/min), "
            f"{r['turns_per_problem_mean']:.2f} turns and {r['tool_calls_per_problem_mean']:.2f} tool calls per problem, "
            f"{r['generated_tokens']} tokens, accuracy strict {r['accuracy']['strict']:.3f} "
            f"flexible {r['accuracy']['flexible']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

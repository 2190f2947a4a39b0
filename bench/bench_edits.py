"""What interventions cost, side by side in one run: the same jobs through the engine's batch
(prefill, then decoding steps, as the worker runs them) with and without edits.

Arms, each timed from the prompts' pass to the last step, end of sequence disabled so every arm
generates the same `--max-tokens`; each ratio is the median over `--repeats` pairs run back to
back, the pair's order alternating:
  one job:       no edits vs one `add` at 3 layers                              (target <= 1.05x)
  16 jobs:       no edits vs 16 distinct edit sets (add, scale, zero, project_out, at
                 different layers, each job its own vector)                     (target <= 1.10x)
  baseline:      the steered job alone vs `baseline: true` (it and its unedited twin in one
                 batch, as the worker runs them)                                 (target <= 1.6x)
  gated:         16 jobs with an ungated `add` vs the same `add` gated by a probe (target <= 1.10x)
Host reads per decoding step (tests/support/host_reads.py) are counted beside their unedited
arms: an edit adds none (a gate's counts are read once, when the job ends; a padded batch has
transformers' own mask check besides the tokens' read).

Models: SmolLM2-135M (the built-in model) and the engine benchmark's tiny random Llama (4 layers,
hidden 64, where the engine's own work dominates a step).

    .venv/bin/python bench/bench_edits.py [--max-tokens 32] [--repeats 5] [--models smollm2,tiny] [--json out.json]
    .venv/bin/python bench/bench_edits.py --device cuda --models tiny,qwen2-0.5b   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support and bench, from a checkout

QUESTIONS = [
    f"Question {i}: a farmer has {i + 3} cows and buys {2 * i + 1} more. Explain how many cows there are now."
    for i in range(16)
]


def engine_for(folder: Path, device: str, dtype: str = "auto"):
    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(folder), model_name="m", device=device, dtype=dtype)))


def vector(width: int, seed: int, scale: float) -> list[float]:
    return (torch.randn(width, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


def edit_set(served, i: int) -> list[dict]:
    """Job i's own edits: one of four kinds, at its own layers, with its own vector."""
    width, layers = served.info.hidden_size, len(served.info.presets["residual"])
    at = [i % layers, (i + 1) % layers]
    kind = i % 4
    if kind == 0:
        return [{"preset": "residual", "layers": at, "op": "add", "vector": vector(width, i, 0.1), "coeff": 1.0 + i}]
    if kind == 1:
        return [{"preset": "residual", "layers": at, "op": "scale", "factor": 0.9, "features": f"0:{width // 2}"}]
    if kind == 2:
        return [{"preset": "residual", "layers": at[:1], "op": "zero", "features": [i, i + 1]}]
    return [{"preset": "residual", "layers": at, "op": "project_out", "vector": vector(width, 100 + i, 1.0)}]


def steering(served, i: int, gated: bool = False) -> list[dict]:
    width = served.info.hidden_size
    layers = len(served.info.presets["residual"])
    edit = {
        "preset": "residual",
        "layers": [layers // 4, layers // 2, 3 * layers // 4],
        "op": "add",
        "vector": vector(width, i, 0.1),
        "coeff": 2.0,
    }
    if gated:
        edit["when"] = {"probe": vector(width, 1000 + i, 1.0), "above": 0.0}
    return [edit]


def sequences(served, jobs: list[tuple[str, list[dict] | None]], max_tokens: int):
    from shared.intervention_check import resolve
    from shared.schemas import JobRequest

    seqs = []
    for text, edits in jobs:
        request = JobRequest(model="m", messages=[{"role": "user", "content": text}], interventions=edits)
        points = resolve(request.interventions, served.info, False, max_tokens) if edits else []
        seqs.append(served.prepare(request, [], max_tokens, None, points))
    return seqs


def timed(served, jobs, max_tokens: int, count_reads: bool = False) -> tuple[float, float | None]:
    """Seconds from the prompts' pass to the last step; host reads per decoding step."""
    from tests.support.host_reads import HostReads

    seqs = sequences(served, jobs, max_tokens)
    with torch.inference_mode():
        decoder = served.decoder()
        decoder.eos_ids = set()  # every arm generates max_tokens
        try:
            started = time.perf_counter()
            decoder.admit_many(seqs)
            reads, steps = None, 0
            if count_reads:
                with HostReads() as counted:
                    while decoder.rows:
                        decoder.step()
                        steps += 1
                reads = counted.count / max(steps, 1)
            else:
                while decoder.rows:
                    decoder.step()
            if served.loaded.device.startswith("cuda"):
                torch.cuda.synchronize()
            return time.perf_counter() - started, reads
        finally:
            decoder.close()


def arms(served) -> dict[str, list[tuple[str, list[dict] | None]]]:
    one = QUESTIONS[0]
    steered = steering(served, 0)
    return {
        "one plain": [(one, None)],
        "one add@3": [(one, steered)],
        "16 plain": [(q, None) for q in QUESTIONS],
        "16 edit sets": [(q, edit_set(served, i)) for i, q in enumerate(QUESTIONS)],
        "baseline pair": [(one, steered), (one, None)],
        "16 add": [(q, steering(served, i)) for i, q in enumerate(QUESTIONS)],
        "16 gated add": [(q, steering(served, i, gated=True)) for i, q in enumerate(QUESTIONS)],
    }


RATIOS = [  # (what, arm, against, target)
    ("one add at 3 layers / no edits", "one add@3", "one plain", 1.05),
    ("16 distinct edit sets / 16 unedited", "16 edit sets", "16 plain", 1.10),
    ("baseline: true / the steered job alone", "baseline pair", "one add@3", 1.6),
    ("gated / ungated (16 jobs)", "16 gated add", "16 add", 1.10),
]


def bench(name: str, served, max_tokens: int, repeats: int) -> dict:
    """Each ratio from `repeats` pairs run back to back (their order alternating, so drift in the
    machine's speed falls on both arms alike): the median of the pairs' ratios, and each arm's
    median time."""
    jobs = arms(served)
    for arm in jobs.values():  # warm every path once
        timed(served, arm, 4)
    times: dict[str, list[float]] = {arm: [] for arm in jobs}
    ratios: dict[str, list[float]] = {what: [] for what, *_ in RATIOS}
    for i in range(repeats):
        for what, arm, against, _ in RATIOS:
            order = (arm, against) if i % 2 else (against, arm)
            got = {one: timed(served, jobs[one], max_tokens)[0] for one in order}
            times[arm].append(got[arm])
            times[against].append(got[against])
            ratios[what].append(got[arm] / got[against])
    reads = {
        arm: timed(served, jobs[arm], max_tokens, count_reads=True)[1]
        for arm in ("one plain", "one add@3", "16 plain", "16 add", "16 gated add")
    }
    medians = {arm: statistics.median(values) for arm, values in times.items() if values}
    out = {"model": name, "median_seconds": medians, "host_reads_per_step": reads, "ratios": []}
    print(f"\n{name}: {max_tokens} tokens per job, {repeats} pairs per ratio (medians)")
    for arm, seconds in medians.items():
        print(f"  {arm:<16} {seconds * 1e3:9.1f} ms")
    for what, _, _, target in RATIOS:
        ratio = statistics.median(ratios[what])
        spread = f"{min(ratios[what]):.3f}-{max(ratios[what]):.3f}"
        out["ratios"].append({"what": what, "ratio": ratio, "range": spread, "target": target})
        print(f"  {what:<42} {ratio:5.3f}x (pairs {spread}; target <= {target})")
    print("  host reads per decoding step: " + ", ".join(f"{k} {v:.2f}" for k, v in reads.items()))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="smollm2,tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    from shared.settings import Settings
    from tests.support.tiny_model import build
    from worker.model.loading import ensure_smollm2

    smol = ensure_smollm2(Settings().model_cache_dir)
    results = {"command": " ".join([sys.executable, *sys.argv]), "runs": []}
    for name in args.models.split(","):
        dtype = "auto"
        if name == "smollm2":
            folder = smol
        elif name == "qwen2-0.5b":  # bench_gpu's random-weight Qwen2-0.5B shape, in bfloat16 (for a GPU)
            from bench.bench_gpu import QWEN2_05B, build_model

            dtype = "bfloat16"
            folder = build_model(Path(tempfile.mkdtemp(prefix="bench-edits-")) / "qwen", QWEN2_05B, dtype)
        else:
            folder = build(Path(tempfile.mkdtemp(prefix="bench-edits-")) / "tiny", smol, max_position_embeddings=4096)
        results["runs"].append(bench(name, engine_for(folder, args.device, dtype), args.max_tokens, args.repeats))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

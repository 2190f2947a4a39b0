"""A steering sweep measured: each strength's metric (GSM8K accuracy, a probe's mean
probability, or the mean generated length) and the positions the edit changed, written as
steering.json and plotted as steering.png."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.cli import batch
from shared.cli.probe_data import job_views, pool, read_file
from shared.cli.steer_options import ProbeMetric, coeff_label
from shared.client import Job

if TYPE_CHECKING:  # pragma: no cover
    from shared.cli.steer import Sweep


def _samples(run_dir: Path) -> list[dict]:
    results = run_dir / "results.jsonl"
    return [json.loads(line) for line in results.read_text().splitlines() if line] if results.exists() else []


def edited_positions(samples: list[dict]) -> int:
    """Positions the steering edit changed, all jobs of a strength together (result.interventions totals)."""
    total = 0
    for sample in samples:
        for report in sample.get("interventions") or []:
            total += int(report.get("total") or 0)
        for trace in (sample.get("traces") or {}).values():
            for report in trace.get("interventions") or []:
                total += int(report.get("total") or 0)
    return total


def interventions_of(job: Job) -> dict:
    """A sample's `interventions` field: the job's result.interventions, when it was steered."""
    found = (job.data.get("result") or {}).get("interventions")
    return {"interventions": found} if found else {}


def gsm8k_metric(run_dir: Path, summary: dict) -> dict:
    accuracy = summary.get("accuracy") or {}
    return {
        "n": summary["succeeded"],
        "metric": accuracy.get("flexible"),
        "strict": accuracy.get("strict"),
        "flexible": accuracy.get("flexible"),
    }


def length_metric(run_dir: Path, summary: dict) -> dict:
    samples = [s for s in _samples(run_dir) if s["status"] == "succeeded"]
    lengths = [s.get("completion_tokens") or 0 for s in samples]
    return {"n": len(samples), "metric": float(np.mean(lengths)) if lengths else None}


def probe_metric(probe: ProbeMetric, fetch: Callable[[dict, str], np.ndarray]) -> Callable[[Path, dict], dict]:
    """The mean probability of the probe's positive class over a strength's succeeded samples."""

    def measure(run_dir: Path, summary: dict) -> dict:
        scores, missing = [], 0
        for sample in _samples(run_dir):
            views = job_views(sample, "sample")
            if sample.get("status") != "succeeded" or not views:
                continue
            _, view, job = views[0]
            entry = next(
                (t for t in (view.get("activations") or {}).get("tensors") or [] if t["name"] == probe.point), None
            )
            if entry is None:
                missing += 1
                continue
            file = view.get("activations_file")
            if file and (run_dir / file).exists():
                rows = read_file(run_dir / file, [probe.point])[probe.point]
            else:
                rows = fetch(view, probe.point)
            pooled, _ = pool(
                rows, entry.get("start", 0), job, entry.get("positions", "all"), entry.get("reduce", "none")
            )
            if probe.pooling not in pooled:
                missing += 1
                continue
            scores.append(probe.score(pooled[probe.pooling]))
        probabilities = [1 / (1 + math.exp(-s)) if s > -700 else 0.0 for s in scores]
        return {
            "n": len(scores),
            "metric": float(np.mean(probabilities)) if scores else None,
            "mean_score": float(np.mean(scores)) if scores else None,
            "not_scored": missing,
        }

    return measure


def report(
    sweep_run: Sweep,
    summaries: dict[float, dict],
    measure: Callable[[Path, dict], dict],
    metric: str,
    model: str | None,
) -> dict:
    """steering.json and steering.png from each strength's results."""
    out, opts, vector = sweep_run.out, sweep_run.opts, sweep_run.vector
    strengths = []
    for coeff in sorted(summaries):
        label = coeff_label(coeff)
        run_dir = out / "steer" / f"coeff={label}"
        summary = summaries[coeff]
        strengths.append(
            {
                "coeff": coeff,
                "dir": f"steer/coeff={label}",
                **measure(run_dir, summary),
                "succeeded": summary["succeeded"],
                "failed": summary["failed"],
                "edited_positions": edited_positions(_samples(run_dir)),
            }
        )
    content: dict[str, Any] = {
        "model": model,
        "module": opts.at,
        "vectors": sweep_run.state.get("vectors"),
        "vector_id": vector.vector_id,
        "name": vector.name,
        "direction": vector.metadata,
        "normalize": opts.normalize,
        "metric": metric,
        "strengths": strengths,
    }
    batch.write_json(out / "steering.json", content)
    plot(content, out / "steering.png")
    return content


METRIC_TITLES = {
    "accuracy_flexible": "GSM8K accuracy",
    "mean_completion_tokens": "mean generated tokens",
}


def plot(content: dict, path: Path) -> None:
    """The metric against the strength (GSM8K: flexible and strict accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in content["strengths"] if r.get("metric") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["coeff"] for r in rows]
    metric = content["metric"]
    if metric == "accuracy_flexible":
        ax.plot(xs, [r["flexible"] for r in rows], marker="o", label="flexible")
        ax.plot(xs, [r["strict"] for r in rows], marker="s", linestyle=":", label="strict")
        ax.set_ylim(-0.05, 1.05)
        ylabel = "accuracy"
    else:
        ax.plot(xs, [r["metric"] for r in rows], marker="o", label=metric)
        ylabel = METRIC_TITLES.get(metric, metric)
        if metric.startswith("probe"):
            ax.set_ylim(-0.05, 1.05)
    reference = next((r for r in rows if r["coeff"] == 0), None)
    if reference is not None:
        ax.axhline(reference["metric"], linestyle="--", color="gray", label="unsteered (coeff 0)")
    if not rows:
        ax.text(0.5, 0.5, "nothing measured", ha="center", transform=ax.transAxes)
    ax.set_xlabel("coeff" + (" (fraction of |x|, --normalize)" if content["normalize"] else ""))
    ax.set_ylabel(ylabel)
    n = max((r["n"] for r in rows), default=0)
    title = f"Steering at {content['module']} with {content['name']} (n={n})"
    ax.set_title(title + (f"\n{content['model']}" if content.get("model") else ""), fontsize="medium")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)

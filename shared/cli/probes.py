"""Linear probes on captured activations (`actq probe`).

Reads a results directory written by `actq gsm8k` or `actq run-file` (`samples/<n>.json`,
`activations/*.safetensors`), pools each capture point of each selected job into vectors
(shared/cli/probe_data.py: the poolings, sources, tool runs' turns and two runs compared), and fits
a standardized, class-balanced logistic regression per (capture point, pooling) predicting a label
(default `answer_correct`: whether the answer's final number is right, for the model's own answer
and for a traced gold or corrupted solution alike), scored by cross-validated balanced accuracy
against a majority-class baseline. Folds are stratified and grouped by problem (or by
`--group-by FIELD`): the rows of one group are never split between training and testing.

Comparing two runs (`--versus OTHER`): the class of a row is its run (`run.json`'s mode,
"with-tools" or "no-tools", else the directory's name): can a probe tell from the activations
whether the model had a tool? The report goes to RESULTS/versus-<OTHER's name>/.

For a label of two classes, each trained probe's direction in activation space is written to
`probe-directions.safetensors` (shared/cli/probe_directions.py), which `actq run-file`/`gsm8k
--steer` read (shared/cli/steer_options.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from shared.cli.probe_data import (
    LABEL_DEFAULT,
    SOURCE_DEFAULT,
    TURNS,
    TURNS_DEFAULT,
    Fetch,
    Job,
    job_views,
    load_comparison,
    load_dataset,
    pool,
    read_file,
    run_names,
)
from shared.cli.probe_directions import (
    DIRECTIONS_FILE,
    NAME_RE,
    Direction,
    direction,
    direction_names,
    write_directions,
)
from shared.errors import ToolError

__all__ = [
    "DIRECTIONS_FILE",
    "LABEL_DEFAULT",
    "NAME_RE",
    "RUN_LABEL",
    "SOURCE_DEFAULT",
    "TURNS",
    "TURNS_DEFAULT",
    "Direction",
    "Fetch",
    "Job",
    "direction",
    "direction_names",
    "fit_probe",
    "job_views",
    "load_comparison",
    "load_dataset",
    "plot",
    "point_layer",
    "pool",
    "read_file",
    "run",
    "run_names",
    "run_with_api",
    "train_probes",
    "versus_dir",
    "write_directions",
]

RUN_LABEL = "run"  # the label of a comparison of two runs (--versus)
LAYER_RE = re.compile(r"\.(\d+)(?=\.|$)")


def point_layer(name: str) -> tuple[int | None, str]:
    """`model.layers.12.mlp` -> (12, "model.layers.*.mlp"); (None, name) when there is no index."""
    match = LAYER_RE.search(name)
    if match is None:
        return None, name
    return int(match.group(1)), name[: match.start(1)] + "*" + name[match.end(1) :]


def train_probes(
    features: dict,
    labels,
    folds: int = 5,
    seed: int = 0,
    groups=None,
    members: dict | None = None,
    directions: dict | None = None,
) -> list[dict]:
    """Cross-validated logistic-regression probes, one entry per (capture point, pooling), each
    over the rows that have that pooling (`members[key]`: their indices into `labels`; all rows
    when not given); folds stratified and, with `groups` (each row's group), grouped: no group in
    two folds.

    Each entry has point, kind, layer, pooling, n, class_counts, the majority baseline
    (majority_accuracy, majority_balanced_accuracy = 1/n_classes) and either folds and
    balanced_accuracy_mean/_std, or `skipped` giving the reason. With `directions` (a dict), each
    trained probe of two classes is also fitted on all its rows and its `Direction` stored there
    under (capture point, pooling)."""
    from threadpoolctl import threadpool_limits

    labels = np.asarray(labels)
    groups = np.arange(len(labels)) if groups is None else np.asarray(groups, dtype=object)

    def order(key):  # by point kind, then layer, then pooling
        layer, kind = point_layer(key[0])
        return kind, -1 if layer is None else layer, key[1]

    entries = []
    with threadpool_limits(limits=1):  # many small fits: BLAS threads cost more than they give
        for key in sorted(features, key=order):
            rows = np.arange(len(labels)) if members is None else members[key]
            picked = labels[rows]
            counts = Counter(picked.tolist())
            entry = _probe(key[0], key[1], features[key], picked, counts, folds, seed, groups[rows])
            entries.append(entry)
            if directions is not None and "skipped" not in entry and len(counts) == 2:
                directions[key] = direction(fit_probe(features[key], picked))
    return entries


def fit_probe(X, labels):
    """The probe `_probe` cross-validates, fitted on all the rows: a standardized, class-balanced
    logistic regression (a scikit-learn pipeline)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, class_weight="balanced"))
    return model.fit(np.asarray(X, dtype=np.float64), np.asarray(labels))


def _probe(name: str, pooling: str, X, labels, counts: Counter, folds: int, seed: int, groups=None) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedGroupKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n, smallest = len(labels), min(counts.values(), default=0)
    layer, kind = point_layer(name)
    entry = {
        "point": name,
        "kind": kind,
        "layer": layer,
        "pooling": pooling,
        "n": n,
        "class_counts": dict(sorted(counts.items())),
        "majority_accuracy": max(counts.values()) / n if n else None,
        "majority_balanced_accuracy": 1 / len(counts) if counts else None,
    }
    if len(counts) < 2:
        entry["skipped"] = f"only one class ({', '.join(counts) or 'no samples'}): nothing to predict"
    elif smallest < 2:
        entry["skipped"] = f"the smallest class has {smallest} sample; cross-validation needs at least 2 per class"
    else:
        groups = np.arange(n) if groups is None else np.asarray([str(g) for g in groups])
        splits = max(2, min(folds, smallest, len(set(groups.tolist()))))
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000, class_weight="balanced"))
        cv = StratifiedGroupKFold(n_splits=splits, shuffle=True, random_state=seed)
        scores = cross_val_score(model, X, labels, cv=cv, groups=groups, scoring="balanced_accuracy")
        entry.update(
            folds=splits, balanced_accuracy_mean=float(scores.mean()), balanced_accuracy_std=float(scores.std())
        )
    return entry


def plot(results: list[dict], path, title: str = "Linear probes") -> None:
    """Balanced accuracy vs layer, one line per (point kind, pooling), std error bars, chance dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    trained = [r for r in results if "skipped" not in r]
    layers = [r["layer"] for r in trained if r["layer"] is not None]
    no_layer_x = max(layers, default=-1) + 1  # points without a layer index go to the right
    groups: dict[tuple, list] = {}
    for r in trained:
        groups.setdefault((r["kind"], r["pooling"]), []).append(r)
    for (kind, pooling), rows in sorted(groups.items()):
        rows.sort(key=lambda r: no_layer_x if r["layer"] is None else r["layer"])
        xs = [no_layer_x if r["layer"] is None else r["layer"] for r in rows]
        ax.errorbar(
            xs,
            [r["balanced_accuracy_mean"] for r in rows],
            yerr=[r["balanced_accuracy_std"] for r in rows],
            marker="o",
            capsize=3,
            label=f"{kind} ({pooling})",
        )
    if trained:
        chance = trained[0]["majority_balanced_accuracy"]
        ax.axhline(chance, linestyle="--", color="gray", label=f"chance / majority baseline ({chance:.2f})")
        ax.legend(fontsize="small")
    else:
        reason = results[0]["skipped"] if results else "no capture points"
        ax.text(0.5, 0.6, f"no probes trained:\n{reason}", ha="center", transform=ax.transAxes)
    ax.set_xlabel("layer")
    ax.set_ylabel("balanced accuracy (cross-validated)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def run(
    results_dir,
    label: str = LABEL_DEFAULT,
    fetch: Fetch | None = None,
    folds: int = 5,
    seed: int = 0,
    source: str = SOURCE_DEFAULT,
    group_by: str | None = None,
    turns: str = TURNS_DEFAULT,
    versus: Path | None = None,
) -> dict:
    """Load, train, plot: writes `<dir>/probes.json`, `<dir>/probes.png` and, for two-class labels,
    `<dir>/probe-directions.safetensors` (each probe's unit direction in activation space, with
    what scores it: see `write_directions`); returns the JSON content. With `versus` (another
    results directory), the label is the run and everything goes to `versus_dir(results_dir, versus)`."""
    if turns not in TURNS:
        raise ToolError(f"--turns {turns!r}: one of {', '.join(TURNS)}")
    results_dir = Path(results_dir)
    if versus is None:
        features, labels, meta = load_dataset(
            results_dir, label=label, fetch=fetch, source=source, group_by=group_by, turns=turns
        )
        out = results_dir
    else:
        label = RUN_LABEL
        features, labels, meta = load_comparison(results_dir, Path(versus), fetch, source, group_by, turns)
        out = versus_dir(results_dir, Path(versus))
        out.mkdir(parents=True, exist_ok=True)
    if meta["n_samples"] == 0:
        raise ToolError(f"no usable samples in {results_dir} (skipped: {meta['skipped']})")
    directions: dict[tuple[str, str], Direction] = {}
    probes = train_probes(
        features,
        labels,
        folds=folds,
        seed=seed,
        groups=meta["groups"],
        members=meta["members"],
        directions=directions,
    )
    summary_path = results_dir / "summary.json"
    model = json.loads(summary_path.read_text()).get("model") if summary_path.exists() else None
    names = write_directions(out / DIRECTIONS_FILE, probes, directions, label, model, meta["points"])
    for entry in probes:
        key = (entry["point"], entry["pooling"])
        if key in directions:
            entry["direction"] = names.get(key)
            entry["positive_class"] = directions[key].positive
    what = ", ".join(f"{n} {s}" for s, n in sorted(meta["sources"].items()))
    title = f"Probes for {label} ({what})" + (f"\n{model}" if model else "")
    plot(probes, out / "probes.png", title=title)
    report = {
        "label": label,
        "source": source,
        "group_by": group_by,
        "turns": turns,
        **({"runs": meta["runs"]} if versus is not None else {}),
        "model": model,
        "n_samples": meta["n_samples"],
        "sources": meta["sources"],
        "skipped_samples": meta["skipped"],
        "notes": meta["notes"],
        "probes": probes,
    }
    (out / "probes.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def versus_dir(results_dir: Path, versus: Path) -> Path:
    """Where a comparison of two runs is written: RESULTS/versus-<OTHER's directory name>."""
    return Path(results_dir) / f"versus-{Path(versus).resolve().name}"


def run_with_api(
    results: Path,
    label: str = LABEL_DEFAULT,
    folds: int = 5,
    api: str | None = None,
    source: str = SOURCE_DEFAULT,
    group_by: str | None = None,
    api_key: str | None = None,
    turns: str = TURNS_DEFAULT,
    versus: Path | None = None,
    retry_timeout: float | None = None,
) -> dict:
    """`run`, fetching activations that were not downloaded one tensor at a time through the API
    (each request retried through an outage for up to `retry_timeout` seconds, default 60)."""
    from shared.cli import remote

    seconds = remote.DEFAULT_SECONDS if retry_timeout is None else retry_timeout
    with remote.client(api, api_key, retry_seconds=seconds) as client:

        def fetch(view: dict, name: str) -> np.ndarray:
            return client.job(view["job_id"]).tensor(name).float().numpy()

        return run(
            results,
            label=label,
            fetch=fetch,
            folds=folds,
            source=source,
            group_by=group_by,
            turns=turns,
            versus=versus,
        )

"""Linear probes on captured activations (`actq probe`).

Reads a results directory written by `actq gsm8k` (`samples/<n>.json`, `activations/*.safetensors`),
pools each capture point per problem and source into vectors ("mean_generated": the mean over the
rows of the answer, i.e. the generated tokens of a generation job or the assistant turn of a trace
job; "last": the last row; a capture reduced by the worker is its one row, pooled as
"reduced_<reduction>"), and fits a standardized, class-balanced logistic regression per (capture
point, pooling) predicting a label (default `answer_correct`: whether the answer's final number is
right, for the model's own answer and for a traced gold or corrupted solution alike), scored by
cross-validated balanced accuracy against a majority-class baseline. Folds are stratified and
grouped by problem: the rows of one problem (its gold and corrupted traces, say) are never split
between training and testing.

Sources (`--source`): `generated` (the generation jobs; the default), a trace name (`gold`,
`corrupted`), or `all` (every source, one row each).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shared.errors import ToolError

POOLINGS = ("mean_generated", "last")
LABEL_DEFAULT = "answer_correct"
LAYER_RE = re.compile(r"\.(\d+)(?=\.|$)")

Fetch = Callable[[dict, str], np.ndarray]


def _lookup(sample: dict, path: str):
    """The value at a dotted path (`correct.flexible`, `meta.difficulty`), or None when absent; a
    name that is not a field is looked up among the sample's `labels` (a prompt file's columns)."""
    value = _walk(sample, path)
    if value is None and isinstance(sample.get("labels"), dict):
        value = _walk(sample["labels"], path)
    return value


def _walk(sample: dict, path: str):
    value = sample
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _class_label(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _read_file(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """The named tensors of a safetensors file as numpy arrays (BF16 via torch, as float32)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="np") as f:
        for name in names:
            if f.get_slice(name).get_dtype() == "BF16":
                from safetensors.torch import load_file  # numpy has no bfloat16

                tensors = load_file(str(path))
                return {n: tensors[n].float().numpy() for n in names}
            out[name] = f.get_tensor(name)
    return out


def _pool(
    rows: np.ndarray, start: int, answer_from: int | None, positions: str = "all", reduce: str = "none"
) -> dict[str, np.ndarray]:
    """Pooled vectors of one [T, H] capture whose row i is token position start + i.

    "mean_generated" averages the rows at positions >= `answer_from` (a generation: prompt_tokens
    - 1, where completion token 1 was predicted; a trace: where the assistant turn starts); it is
    left out for positions "prompt" and whenever there are no such rows. A reduced capture (one
    row) is pooled as "reduced_<reduction>" only."""
    rows = np.asarray(rows, dtype=np.float32)
    if reduce != "none":
        return {f"reduced_{reduce}": rows[0]}
    pooled = {"last": rows[-1]}
    if answer_from is None:
        return pooled
    first_generated = max(0, answer_from - start)
    if positions != "prompt" and first_generated < len(rows):
        pooled["mean_generated"] = rows[first_generated:].mean(axis=0)
    return pooled


def _views(sample: dict, source: str) -> list[tuple[str, dict]]:
    """(source, view) for each capture of a sample that `source` selects. A view has `status`,
    `job_id`, `activations`, `activations_file`, `answer_from` and the label fields: the
    generation's are the sample's own; a trace's are its entry in `traces`, then the sample's.
    `answer_correct` is correct.flexible for a generation, and the trace's `correct`."""
    views = []
    if source in ("generated", "all") and sample.get("job_id"):
        span = sample.get("completion_span")  # a prompt file's trace line: where its scored reply starts
        answer = span[0] if span else (sample.get("prompt_tokens") or 1) - 1
        correct = (sample.get("correct") or {}).get("flexible")
        views.append(("generated", {**sample, "answer_from": answer, "answer_correct": correct}))
    for name, trace in sorted((sample.get("traces") or {}).items()):
        if source in (name, "all"):
            span = trace.get("completion_span")
            view = {**sample, **trace, "answer_from": span[0] if span else None, "answer_correct": trace.get("correct")}
            views.append((name, view))
    return views


def load_dataset(results_dir, label: str = LABEL_DEFAULT, fetch: Fetch | None = None, source: str = "generated"):
    """Pooled features and labels for every succeeded capture of the chosen source with activations.

    Returns `(features, labels, meta)`: `features` maps `(capture point, pooling)` to an
    `[n_rows, H]` float32 array, `labels` is an array of class-label strings, and `meta` holds
    `n_samples` (rows), `indices` (each row's problem index: the CV groups), `sources`, `skipped`
    (counts by reason) and `notes`. Activations are read from `activations_file` when it exists,
    else through `fetch(view, tensor_name)`; with neither, raises ToolError."""
    results_dir = Path(results_dir)
    paths = sorted((results_dir / "samples").glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else p.stem)
    if not paths:
        raise ToolError(
            f"{results_dir}/samples holds no sample files: "
            "is this a results directory of `actq gsm8k` or `actq run-file`?"
        )
    skipped: Counter = Counter()
    per_sample: list[dict] = []
    labels: list[str] = []
    indices: list = []
    sources: list[str] = []
    for path in paths:
        sample = json.loads(path.read_text())
        views = _views(sample, source)
        if not views:
            skipped[f"no_{source}_capture"] += 1
        for name, view in views:
            value = _lookup(view, label)
            if view.get("status") != "succeeded":
                skipped["failed"] += 1
                continue
            if value is None:
                skipped["missing_label"] += 1
                continue
            manifest = view.get("activations")
            if not manifest or not manifest.get("tensors"):
                skipped["no_activations"] += 1
                continue
            entries = [t for t in manifest["tensors"] if t["name"] != "token_ids"]
            file = view.get("activations_file")
            if file and (results_dir / file).exists():
                tensors = _read_file(results_dir / file, [t["name"] for t in entries])
            elif fetch is not None:
                tensors = {t["name"]: fetch(view, t["name"]) for t in entries}
            else:
                raise ToolError(
                    f"sample {sample.get('index')} ({name}): its activations are not in {results_dir}; "
                    "run `actq gsm8k` or `actq run-file` with --download, or give --api so they can be fetched"
                )
            pooled = {}
            for t in entries:
                vectors = _pool(
                    tensors[t["name"]],
                    t.get("start", 0),
                    view["answer_from"],
                    t.get("positions", "all"),
                    t.get("reduce", "none"),
                )
                pooled.update({(t["name"], pooling): v for pooling, v in vectors.items()})
            per_sample.append(pooled)
            labels.append(_class_label(value))
            indices.append(sample.get("index", path.stem))
            sources.append(name)
    notes = []
    keys = set.intersection(*(set(p) for p in per_sample)) if per_sample else set()
    for name in sorted({k[0] for p in per_sample for k in p}):
        if not any(k[0] == name for k in keys):
            notes.append(f"{name}: not captured in every sample; skipped")
        elif (name, "last") in keys and (name, "mean_generated") not in keys:
            notes.append(f"{name}: mean_generated skipped (no answer rows, e.g. positions 'prompt')")
    features = {k: np.stack([p[k] for p in per_sample]) for k in sorted(keys)}
    meta = {
        "n_samples": len(per_sample),
        "indices": indices,
        "sources": dict(Counter(sources)),
        "skipped": dict(skipped),
        "notes": notes,
    }
    return features, np.array(labels, dtype=object), meta


def point_layer(name: str) -> tuple[int | None, str]:
    """`model.layers.12.mlp` -> (12, "model.layers.*.mlp"); (None, name) when there is no index."""
    match = LAYER_RE.search(name)
    if match is None:
        return None, name
    return int(match.group(1)), name[: match.start(1)] + "*" + name[match.end(1) :]


def train_probes(features: dict, labels, folds: int = 5, seed: int = 0, groups=None) -> list[dict]:
    """Cross-validated logistic-regression probes, one entry per (capture point, pooling); folds
    stratified and, with `groups` (each row's problem), grouped: no problem in two folds.

    Each entry has point, kind, layer, pooling, n, class_counts, the majority baseline
    (majority_accuracy, majority_balanced_accuracy = 1/n_classes) and either folds and
    balanced_accuracy_mean/_std, or `skipped` giving the reason."""
    from threadpoolctl import threadpool_limits

    labels = np.asarray(labels)
    counts = Counter(labels.tolist())

    def order(key):  # by point kind, then layer, then pooling
        layer, kind = point_layer(key[0])
        return kind, -1 if layer is None else layer, key[1]

    with threadpool_limits(limits=1):  # many small fits: BLAS threads cost more than they give
        return [
            _probe(name, pooling, features[(name, pooling)], labels, counts, folds, seed, groups)
            for name, pooling in sorted(features, key=order)
        ]


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
        groups = np.arange(n) if groups is None else np.asarray(groups)
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
    source: str = "generated",
) -> dict:
    """Load, train, plot: writes `<dir>/probes.json` and `<dir>/probes.png`; returns the JSON content."""
    results_dir = Path(results_dir)
    features, labels, meta = load_dataset(results_dir, label=label, fetch=fetch, source=source)
    if meta["n_samples"] == 0:
        raise ToolError(f"no usable samples in {results_dir} (skipped: {meta['skipped']})")
    probes = train_probes(features, labels, folds=folds, seed=seed, groups=meta["indices"])
    summary_path = results_dir / "summary.json"
    model = json.loads(summary_path.read_text()).get("model") if summary_path.exists() else None
    what = ", ".join(f"{n} {s}" for s, n in sorted(meta["sources"].items()))
    title = f"Probes for {label} ({what})" + (f"\n{model}" if model else "")
    plot(probes, results_dir / "probes.png", title=title)
    report = {
        "label": label,
        "source": source,
        "model": model,
        "n_samples": meta["n_samples"],
        "sources": meta["sources"],
        "skipped_samples": meta["skipped"],
        "notes": meta["notes"],
        "probes": probes,
    }
    (results_dir / "probes.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_with_api(
    results: Path, label: str = LABEL_DEFAULT, folds: int = 5, api: str | None = None, source: str = "generated"
) -> dict:
    """`run`, fetching activations that were not downloaded one tensor at a time through the API."""
    from shared.client import Client
    from shared.settings import Settings

    with Client(api or Settings().api_url, timeout=60) as client:

        def fetch(view: dict, name: str) -> np.ndarray:
            return client.job(view["job_id"]).tensor(name).float().numpy()

        return run(results, label=label, fetch=fetch, folds=folds, source=source)

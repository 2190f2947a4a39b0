"""Linear probes on captured activations (`actq probe`).

Reads a results directory written by `actq gsm8k` or `actq run-file` (`samples/<n>.json`,
`activations/*.safetensors`), pools each capture point of each selected job into vectors, and fits
a standardized, class-balanced logistic regression per (capture point, pooling) predicting a label
(default `answer_correct`: whether the answer's final number is right, for the model's own answer
and for a traced gold or corrupted solution alike), scored by cross-validated balanced accuracy
against a majority-class baseline. Folds are stratified and grouped by problem (or by
`--group-by FIELD`): the rows of one group are never split between training and testing.

Every pooling is computed from exactly the rows its name says, and a job that has no such rows
(or whose capture does not hold all of them) is left out of that pooling's probes with a note,
never given another pooling's vector: `last` (the last captured row), `mean_all` (every position
the job ran), `mean_generated` (a generation: the positions that predicted each generated token),
`mean_completion` (a trace: its final assistant turn, `completion_span`); a capture the worker
reduced is its one row, `reduced_<reduction>`.

Sources (`--source`): `sample` (each sample's own job: a problem's answer, a prompt line's job; the
default), `generated` or `trace` (own jobs of that kind), a GSM8K trace name (`gold`,
`corrupted`), or `all` (every job, one row each).

Tool runs (`actq gsm8k --mode with-tools`, run-file lines with `tools`): a problem is a
conversation of several jobs (`turn_jobs`), and `--turns` picks which: `last` (the default: the
turn whose text is the answer, the sample's own job), `first` (the turn that read the question
and chose whether to call a tool), or `all` (one row per turn, a problem's turns kept in one fold).

Comparing two runs (`--versus OTHER`): the rows of both results directories, the class of a row
being its run (`run.json`'s mode, "with-tools" or "no-tools", else the directory's name): can a
probe tell from the activations whether the model had a tool? Rows are grouped by problem across
both runs (the same problem's rows are never split between training and testing). The report
goes to RESULTS/versus-<OTHER's name>/.

For a label of two classes, each trained probe is also fitted on all its rows and its direction
written to `probe-directions.safetensors` (`write_directions`): the unit vector in activation
space (coef / scale, normalized; toward the positive class, the second in sorted order), named
`<point>:<pooling>`, and `<point>` for the point's best pooling, with the `norm` and `bias` that
give the probe's score on a raw pooled activation x: `norm * (unit . x) + bias` (the pipeline's
decision_function). `actq run-file`/`gsm8k --steer` read it (shared/cli/steer.py).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from shared.errors import ToolError

LABEL_DEFAULT = "answer_correct"
SOURCE_DEFAULT = "sample"
TURNS = ("last", "first", "all")
TURNS_DEFAULT = "last"
RUN_LABEL = "run"  # the label of a comparison of two runs (--versus)
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


class Job(NamedTuple):
    """What pooling needs to know of one job: its kind ("generated" or "trace"), the prompt tokens
    it read, the tokens it generated, and a trace's final assistant turn `[start, stop)`."""

    kind: str
    prompt_tokens: int
    completion_tokens: int = 0
    completion_span: tuple[int, int] | None = None

    @property
    def fed(self) -> int:
        """Positions the model ran: a generation never feeds back its last token."""
        return (
            self.prompt_tokens + max(self.completion_tokens - 1, 0) if self.kind == "generated" else self.prompt_tokens
        )


def _mean(rows: np.ndarray, start: int, first: int, stop: int, what: str, positions: str) -> np.ndarray | str:
    """The mean of the rows at positions [first, stop) (row i is position start + i), or why not."""
    if first >= stop:
        return f"no {what}"
    if first < start or stop > start + len(rows):
        return f"the capture (positions {positions!r}) does not hold every position of the {what}"
    return rows[first - start : stop - start].mean(axis=0)


def pool(
    rows: np.ndarray, start: int, job: Job, positions: str = "all", reduce: str = "none"
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Pooled vectors of one [T, H] capture whose row i is position start + i, and for each pooling
    this job's kind has but this capture cannot give, why (it is never substituted).

    `last`: the last captured row. `mean_all`: the mean over every position the job ran (all of a
    trace, prompt and generated tokens of a generation). `mean_generated` (generations): the mean
    over the positions that predicted each generated token, [prompt_tokens - 1, fed).
    `mean_completion` (traces): the mean over the final assistant turn, `completion_span`. A
    reduced capture (one row) is `reduced_<reduction>` only."""
    rows = np.asarray(rows, dtype=np.float32)
    if reduce != "none":
        return {f"reduced_{reduce}": rows[0]}, {}
    wanted: dict[str, np.ndarray | str] = {"mean_all": _mean(rows, start, 0, job.fed, "job's positions", positions)}
    if job.kind == "generated":
        first = job.prompt_tokens - 1
        wanted["mean_generated"] = _mean(rows, start, first, job.fed, "generated tokens", positions)
    elif job.completion_span is None:
        wanted["mean_completion"] = "no completion (the trace has no final assistant turn)"
    else:
        span = job.completion_span
        wanted["mean_completion"] = _mean(rows, start, span[0], span[1], "completion", positions)
    pooled = {"last": rows[-1]} if len(rows) else {}
    pooled |= {k: v for k, v in wanted.items() if not isinstance(v, str)}
    return pooled, {k: v for k, v in wanted.items() if isinstance(v, str)}


def _job(view: dict, kind: str) -> Job:
    span = view.get("completion_span")
    return Job(
        kind=kind,
        prompt_tokens=int(view.get("prompt_tokens") or 0),
        completion_tokens=int(view.get("completion_tokens") or 0) if kind == "generated" else 0,
        completion_span=(int(span[0]), int(span[1])) if span else None,
    )


def _turn_views(sample: dict, view: dict, turns: str) -> list[dict]:
    """A tool run's sample's own job as the views `turns` picks (first, last or every turn's job,
    each with its `turn`); a sample without turns: its one view."""
    jobs = sample.get("turn_jobs")
    if not jobs or turns == "last":
        return [view if not jobs else {**view, "turn": jobs[-1].get("turn")}]
    picked = jobs[:1] if turns == "first" else jobs
    return [{**view, **job} for job in picked]


def _views(sample: dict, source: str, turns: str = TURNS_DEFAULT) -> list[tuple[str, dict, Job]]:
    """(source, view, job) for each capture of a sample that `source` selects.

    A sample's own job (a GSM8K problem's answer, a prompt line's job) is the source `generated`
    when it generated and `trace` when it traced (a prompt file's `mode: trace` line); a GSM8K
    run's traces are named by their kind (`gold`, `corrupted`). `source`: `sample` (each sample's
    own job), `generated`, `trace`, a trace name, or `all`. A view has `status`, `job_id`,
    `activations`, `activations_file` and the label fields: the own job's are the sample's; a
    trace's are its entry in `traces`, then the sample's. `answer_correct` is correct.flexible for
    a generation, and the trace's `correct`. A tool run's own job is the turns `turns` picks
    (`_turn_views`), each turn labelled with the conversation's answer."""
    views = []
    if sample.get("job_id"):
        kind = "trace" if sample.get("mode") == "trace" else "generated"
        if source in ("sample", kind, "all"):
            correct = (sample.get("correct") or {}).get("flexible") if kind == "generated" else sample.get("correct")
            for view in _turn_views(sample, {**sample, "answer_correct": correct}, turns):
                views.append((kind, view, _job(view, kind)))
    for name, trace in sorted((sample.get("traces") or {}).items()):
        if source in (name, "all"):
            view = {**sample, **trace, "answer_correct": trace.get("correct")}
            views.append((name, view, _job(view, "trace")))
    return views


def load_dataset(
    results_dir,
    label: str = LABEL_DEFAULT,
    fetch: Fetch | None = None,
    source: str = SOURCE_DEFAULT,
    group_by: str | None = None,
    turns: str = TURNS_DEFAULT,
    class_label: str | None = None,
):
    """Pooled features and labels for every succeeded capture of the chosen source with activations
    (of a tool run, of the turns `turns` picks); `class_label`: every row's label is that (a run's
    name, when two runs are compared), not the `label` field.

    Returns `(features, labels, meta)`: `features` maps `(capture point, pooling)` to an
    `[n, H]` float32 array over the rows that have that pooling (`meta["members"][key]`: their
    indices into `labels`), `labels` is an array of class-label strings, and `meta` holds
    `n_samples` (rows), `groups` (each row's CV group: its problem, or its `group_by` value),
    `sources`, `skipped` (counts by reason) and `notes` (each pooling refused for some rows, with
    why). Activations are read from `activations_file` when it exists, else through
    `fetch(view, tensor_name)`; with neither, raises ToolError."""
    results_dir = Path(results_dir)
    paths = sorted((results_dir / "samples").glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else p.stem)
    if not paths:
        raise ToolError(
            f"{results_dir}/samples holds no sample files: "
            "is this a results directory of `actq gsm8k` or `actq run-file`?"
        )
    skipped: Counter = Counter()
    refused: dict[tuple[str, str], set[int]] = {}  # (pooling, why) -> the rows it was refused for
    captured: dict[str, set[int]] = {}  # capture point -> the rows that have it
    points: dict[str, dict] = {}  # capture point -> its module and hook (from the manifests)
    features: dict[tuple[str, str], list[np.ndarray]] = {}
    members: dict[tuple[str, str], list[int]] = {}
    labels: list[str] = []
    groups: list = []
    sources: list[str] = []
    for path in paths:
        sample = json.loads(path.read_text())
        views = _views(sample, source, turns)
        if not views:
            skipped[f"no_{source}_capture"] += 1
        for name, view, job in views:
            value = class_label if class_label is not None else _lookup(view, label)
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
            group = sample.get("index", path.stem)
            if group_by is not None:
                group = _lookup(view, group_by)
                if group is None:
                    raise ToolError(f"--group-by {group_by}: sample {sample.get('index', path.stem)} has no such field")
                group = json.dumps(group, sort_keys=True)
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
            row = len(labels)
            for t in entries:
                positions = t.get("positions", "all")
                vectors, why = pool(tensors[t["name"]], t.get("start", 0), job, positions, t.get("reduce", "none"))
                for pooling, vector in vectors.items():
                    features.setdefault((t["name"], pooling), []).append(vector)
                    members.setdefault((t["name"], pooling), []).append(row)
                for pooling, reason in why.items():
                    refused.setdefault((pooling, reason), set()).add(row)
                captured.setdefault(t["name"], set()).add(row)
                points.setdefault(t["name"], {"module": t.get("module", t["name"]), "hook": t.get("hook", "output")})
            labels.append(_class_label(value))
            groups.append(group)
            sources.append(name)
    notes = [
        f"{pooling}: not computed for {len(rows)} of {len(labels)} rows ({why}); those rows are left out of its probes"
        for (pooling, why), rows in sorted(refused.items())
    ]
    notes += [
        f"{name}: captured in {len(rows)} of {len(labels)} rows; its probes use those"
        for name, rows in sorted(captured.items())
        if len(rows) < len(labels)
    ]
    meta = {
        "n_samples": len(labels),
        "groups": groups,
        "members": {k: np.asarray(v) for k, v in members.items()},
        "sources": dict(Counter(sources)),
        "skipped": dict(skipped),
        "notes": notes,
        "points": points,
    }
    return {k: np.stack(v) for k, v in features.items()}, np.array(labels, dtype=object), meta


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


class Direction(NamedTuple):
    """A two-class probe in activation space: its score on a raw activation x (the pipeline's
    `decision_function`, > 0 for `positive`) is `norm * (unit . x) + bias`."""

    unit: np.ndarray  # float64 [H], unit norm, pointing toward the positive class
    norm: float  # |w_raw|
    bias: float  # b_raw
    positive: str  # the class a positive score predicts (the second in sorted order: "true" for booleans)
    negative: str


def direction(model) -> Direction:
    """Undo the standardizer: z = (x - mean) / scale, so coef . z + b = w_raw . x + b_raw with
    w_raw = coef / scale and b_raw = b - coef . (mean / scale)."""
    scaler, regression = model[0], model[-1]
    coef = np.asarray(regression.coef_[0], dtype=np.float64)
    w_raw = coef / scaler.scale_
    b_raw = float(regression.intercept_[0] - np.dot(coef, scaler.mean_ / scaler.scale_))
    norm = float(np.linalg.norm(w_raw))
    unit = w_raw / norm if norm > 0 else w_raw
    negative, positive = (str(c) for c in regression.classes_)
    return Direction(unit=unit, norm=norm, bias=b_raw, positive=positive, negative=negative)


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


def run_names(first: Path, second: Path) -> tuple[str, str]:
    """The classes of a comparison: each run's mode (run.json, "with-tools"/"no-tools") when they
    differ, else the directories' names, else "first" and "second"."""

    def mode(path: Path) -> str | None:
        state = path / "run.json"
        return json.loads(state.read_text()).get("settings", {}).get("mode") if state.exists() else None

    for a, b in ((mode(first), mode(second)), (first.resolve().name, second.resolve().name)):
        if a and b and a != b:
            return str(a), str(b)
    return "first", "second"


def load_comparison(first: Path, second: Path, fetch: Fetch | None, source: str, group_by: str | None, turns: str):
    """`load_dataset` of two results directories, each row labelled with its run (`run_names`):
    the features of both stacked, groups shared across them (a problem's rows of both runs in one
    fold)."""
    if first.resolve() == second.resolve():
        raise ToolError(f"--versus {second}: that is the results directory itself; give another run to compare with")
    names = run_names(first, second)
    parts = [
        load_dataset(path, fetch=fetch, source=source, group_by=group_by, turns=turns, class_label=name)
        for path, name in zip((first, second), names, strict=True)
    ]
    (fa, la, ma), (fb, lb, mb) = parts
    offset = len(la)
    features, members = {}, {}
    for key in sorted(fa.keys() | fb.keys()):
        stacks = [f[key] for f in (fa, fb) if key in f]
        features[key] = np.concatenate(stacks)
        rows = [ma["members"][key]] if key in fa else []
        rows += [mb["members"][key] + offset] if key in fb else []
        members[key] = np.concatenate(rows)
    meta = {
        "n_samples": offset + len(lb),
        "groups": ma["groups"] + mb["groups"],
        "members": members,
        "sources": {f"{n}:{s}": c for n, m in zip(names, (ma, mb), strict=True) for s, c in m["sources"].items()},
        "skipped": {f"{n}:{s}": c for n, m in zip(names, (ma, mb), strict=True) for s, c in m["skipped"].items()},
        "notes": [f"{n}: {note}" for n, m in zip(names, (ma, mb), strict=True) for note in m["notes"]],
        "points": {**mb["points"], **ma["points"]},
        "runs": {names[0]: str(first), names[1]: str(second)},
    }
    return features, np.concatenate([la, lb]), meta


DIRECTIONS_FILE = "probe-directions.safetensors"
NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,200}$")  # a vector set's tensor names (POST /vectors)


def direction_names(point: str, pooling: str, best: bool) -> list[str]:
    """A probe's tensor names in the directions file: `<point>:<pooling>`, and `<point>` alone for
    the pooling with the best balanced accuracy at that point."""
    return [f"{point}:{pooling}", *([point] if best else [])]


def write_directions(
    path: Path, probes: list[dict], directions: dict, label: str, model: str | None, points: dict[str, dict]
) -> dict[tuple[str, str], str]:
    """Write every two-class probe's unit direction in activation space as a safetensors vector
    set (float32 [H] each) with its metadata; returns (point, pooling) -> its `<point>:<pooling>`
    name. No trained two-class probe: no file (a stale one is removed)."""
    from safetensors.numpy import save_file

    trained = [p for p in probes if (p["point"], p["pooling"]) in directions]
    best: dict[str, dict] = {}
    for entry in trained:
        if (
            entry["point"] not in best
            or entry["balanced_accuracy_mean"] > best[entry["point"]]["balanced_accuracy_mean"]
        ):
            best[entry["point"]] = entry
    tensors: dict[str, np.ndarray] = {}
    metadata = {"actq": json.dumps({"kind": "probe-directions", "label": label, "model": model})}
    named: dict[tuple[str, str], str] = {}
    for entry in trained:
        key = (entry["point"], entry["pooling"])
        found = directions[key]
        info = {
            "point": entry["point"],
            **points.get(entry["point"], {"module": entry["point"], "hook": "output"}),
            "layer": entry["layer"],
            "label": label,
            "positive_class": found.positive,
            "negative_class": found.negative,
            "pooling": entry["pooling"],
            "balanced_accuracy": round(entry["balanced_accuracy_mean"], 6),
            "n": entry["n"],
            "norm": found.norm,
            "bias": found.bias,
            "model": model,
        }
        for name in direction_names(*key, best=best[entry["point"]] is entry):
            if NAME_RE.match(name):
                tensors[name] = found.unit.astype(np.float32)
                metadata[name] = json.dumps(info)
                named.setdefault(key, name)
    if not tensors:
        path.unlink(missing_ok=True)
        return {}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return named


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

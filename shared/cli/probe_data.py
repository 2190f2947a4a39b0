"""A probe's rows (`actq probe`): the jobs of a results directory that a source selects, each
capture point pooled into vectors, with its label and its cross-validation group.

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

Comparing two runs (`--versus OTHER`, `load_comparison`): the rows of both results directories,
each labelled with its run; a problem's rows of both runs share one group.
"""

from __future__ import annotations

import json
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


def read_file(path: Path, names: list[str]) -> dict[str, np.ndarray]:
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


def job_views(sample: dict, source: str, turns: str = TURNS_DEFAULT) -> list[tuple[str, dict, Job]]:
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
        views = job_views(sample, source, turns)
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
                tensors = read_file(results_dir / file, [t["name"] for t in entries])
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

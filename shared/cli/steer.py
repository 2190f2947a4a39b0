"""Steering sweeps: `actq gsm8k` and `actq run-file` with `--steer VECTORS --at MODULE --coeff C
[--coeff C ...]` run the whole dataset once per strength, adding `C * v` to MODULE's output at
every position (an `add` intervention, docs/interventions.md), and measure each strength.

VECTORS is a local safetensors file (one tensor is uploaded, with `POST /vectors`, as a set of
its own; its id is kept in OUT/steer/run.json, so a resumed run reuses it) or the id of a vector
set already on the server. The tensor: `--steer-name NAME`, else the one named exactly MODULE,
else the file's only tensor. Coefficient 0 runs without interventions (the unsteered
reference).

Results directory:
  steer/run.json          the steering settings: the vectors (file and sha256, or id), the tensor
                          name, the vector set's id, the module, --normalize
  steer/coeff=<C>/        one results directory per strength, the usual layout (run.json,
                          jobs.json, samples/, results.jsonl, summary.json), resumable; a steered
                          sample also keeps its job's `interventions` (positions edited per step)
  steering.json           per strength: n, the metric (and for GSM8K strict and flexible accuracy),
                          the positions the edit changed
  steering.png            the metric against the strength

Metrics: GSM8K, the flexible accuracy of the generated answers (strict beside it); a prompt file,
with `--probe FILE[:NAME]` (a probe of `actq probe`'s probe-directions.safetensors), the mean
probability of the probe's positive class on each job's captured activation at the probe's
point, pooled as the probe was trained (the capture gets the probe's module added); without
`--probe`, the mean number of generated tokens.

Every strength's jobs are submitted together, problem by problem (batch.execute_many), a steered
one first: an edit the API refuses (a module the model lacks, a vector of the wrong width) is its
422 message in one line before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from safetensors import SafetensorError

from shared.cli import batch, probes
from shared.cli.remote import one_line
from shared.client import ActqClientError, Client, Job
from shared.errors import ToolError

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_COEFF = 1e4  # the API's limit on `coeff`
STATE = "run.json"  # in OUT/steer/


@dataclass
class Options:
    """What the steering options ask for (checked, before anything talks to the API)."""

    vectors: str  # a safetensors file or a vector-set id
    at: str
    coeffs: list[float]
    name: str | None = None
    normalize: bool = False
    probe: str | None = None  # run-file's metric: FILE[:NAME]


@dataclass
class Vector:
    """The steering vector chosen: from a local file (`values`, to upload) or a set on the server."""

    name: str
    values: np.ndarray | None = None
    metadata: dict | None = None  # its entry in the file's __metadata__ (a probe's: module, label, ...)
    path: str | None = None
    sha256: str | None = None
    vector_id: str | None = None


@dataclass
class ProbeMetric:
    """A probe of `actq probe`'s directions file: score = norm * (unit . x) + bias on the pooled
    activation x at `point`; the metric is the logistic of it (the positive class's probability)."""

    spec: str
    name: str
    point: str
    module: str
    hook: str
    pooling: str
    unit: np.ndarray
    norm: float
    bias: float
    label: str
    positive: str

    def score(self, x: np.ndarray) -> float:
        return float(self.norm * np.dot(self.unit, np.asarray(x, dtype=np.float64)) + self.bias)


def coeff_label(coeff: float) -> str:
    """A strength as a directory name: 4.0 -> "4", -0.5 -> "-0.5"."""
    text = repr(float(coeff))
    return text[:-2] if text.endswith(".0") else text


def parse_coeff(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ToolError(f"--coeff {text!r} is not a number; give a finite number like 4 or -0.5") from None
    if not math.isfinite(value) or abs(value) > MAX_COEFF:
        raise ToolError(f"--coeff {text!r}: give a finite number of magnitude at most {MAX_COEFF:g}")
    return value + 0.0  # -0.0 -> 0.0


def options(
    steer: str | None,
    at: str | None,
    coeff: list[str] | None,
    steer_name: str | None = None,
    normalize: bool = False,
    probe: str | None = None,
) -> Options | None:
    """The steering options checked together; None when there is no --steer."""
    if steer is None:
        given = [
            flag
            for flag, value in (("--at", at), ("--coeff", coeff), ("--steer-name", steer_name), ("--probe", probe))
            if value
        ] + (["--normalize"] if normalize else [])
        if given:
            raise ToolError(
                f"{', '.join(given)} steer a run: add --steer VECTORS (a safetensors file or a vector-set id)"
            )
        return None
    if not at:
        raise ToolError(
            "--steer needs --at MODULE: the module whose output the vector is added to (e.g. model.layers.12)"
        )
    if not coeff:
        raise ToolError("--steer needs --coeff C (repeatable, e.g. --coeff 0 --coeff 8; 0 is the unsteered reference)")
    coeffs: list[float] = []
    for text in coeff:
        value = parse_coeff(text)
        if value not in coeffs:
            coeffs.append(value)
    return Options(vectors=steer, at=at, coeffs=coeffs, name=steer_name, normalize=normalize, probe=probe)


def _pick(names: list[str], name: str | None, at: str, where: str) -> str:
    listed = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
    if name is not None:
        if name not in names:
            raise ToolError(f"{where} has no tensor {name!r} (it has {listed}); name one with --steer-name")
        return name
    if at in names:
        return at
    if len(names) == 1:
        return names[0]
    raise ToolError(
        f"{where} has {len(names)} tensors and none named {at!r} (the --at module); "
        f"pick one with --steer-name NAME (it has {listed})"
    )


def _entry(metadata: dict | None, name: str) -> dict | None:
    """A tensor's metadata entry when it is a JSON object (what `actq probe` writes), else None."""
    try:
        value = json.loads((metadata or {})[name])
    except (KeyError, TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_tensor(path: Path, name: str | None, at: str, flag: str = "--steer") -> Vector:
    """One vector [W] of a local safetensors file, as float32, with its metadata entry."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            metadata = f.metadata()
            chosen = _pick(names, name, at, str(path))
            tensor = f.get_tensor(chosen)
    except ToolError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:  # safetensors' own errors: malformed
        raise ToolError(
            f"{flag} {path}: not a safetensors file ({one_line(exc)[:200]}); give one written by safetensors "
            "(e.g. `actq probe`'s probe-directions.safetensors) or a vector-set id"
        ) from None
    if tensor.dim() != 1 or not tensor.is_floating_point():
        raise ToolError(
            f"{flag} {path}: tensor {chosen!r} is {tuple(tensor.shape)} {tensor.dtype}; give one vector [W]"
        )
    values = tensor.float().numpy()
    if not np.isfinite(values).all():
        raise ToolError(f"{flag} {path}: tensor {chosen!r} holds NaN or inf")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Vector(chosen, values, _entry(metadata, chosen), str(path), digest)


def read_vector(opts: Options) -> Vector:
    """--steer's vector from a local file, or the id of a set on the server (checked later)."""
    path = Path(opts.vectors).expanduser()
    if path.is_file():
        return read_tensor(path, opts.name, opts.at)
    if UUID_RE.match(opts.vectors):
        return Vector(name=opts.name or "", vector_id=opts.vectors)
    raise ToolError(f"--steer {opts.vectors!r}: no such file, and not a vector-set id (the uuid POST /vectors answers)")


def read_probe(spec: str, default_name: str | None = None) -> ProbeMetric:
    """--probe FILE[:NAME]: a probe of a directions file written by `actq probe` (NAME may hold
    colons: the file is the longest existing prefix before one)."""
    path, name = Path(spec).expanduser(), None
    if not path.is_file():
        for at in [m.start() for m in re.finditer(":", spec)][::-1]:
            if Path(spec[:at]).expanduser().is_file():
                path, name = Path(spec[:at]).expanduser(), spec[at + 1 :]
                break
        else:
            raise ToolError(f"--probe {spec!r}: no such file (give FILE or FILE:NAME, a probe-directions.safetensors)")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ToolError(f"--probe {path}: not a safetensors file ({one_line(exc)[:200]})") from None
    if name is None and default_name in names:
        name = default_name
    if name is None and len(names) != 1:
        raise ToolError(f"--probe {path} holds {len(names)} probes: name one, --probe {path}:NAME")
    vector = read_tensor(path, name, "", flag="--probe")
    meta = vector.metadata or {}
    if not all(k in meta for k in ("point", "module", "hook", "pooling", "norm", "bias")):
        raise ToolError(
            f"--probe {path}: tensor {vector.name!r} has no probe metadata (point, pooling, norm, bias); "
            "give a probe-directions.safetensors written by `actq probe`"
        )
    assert vector.values is not None
    return ProbeMetric(
        spec=spec,
        name=vector.name,
        point=meta["point"],
        module=meta["module"],
        hook=meta["hook"],
        pooling=meta["pooling"],
        unit=vector.values.astype(np.float64),
        norm=float(meta["norm"]),
        bias=float(meta["bias"]),
        label=str(meta.get("label")),
        positive=str(meta.get("positive_class")),
    )


def capture_with_probe(capture: dict | None, info: dict | None, probe: ProbeMetric) -> dict:
    """The run's capture with the probe's module added (a capture of it alone with --no-capture),
    refused when its hook or reduction cannot give the probe's pooling."""
    reduced = probe.pooling.startswith("reduced_")
    if capture is None:
        positions = "generated" if probe.pooling == "mean_generated" else "all"
        capture = {"modules": [], "hook": probe.hook, "positions": positions, "dtype": "float32"}
        if reduced:
            capture["reduce"] = probe.pooling.removeprefix("reduced_")
    capture = {**capture, "modules": list(capture.get("modules") or [])}
    where = f"--probe {probe.spec}"
    if capture.get("hook", "output") != probe.hook:
        raise ToolError(f"{where} reads the {probe.hook} of {probe.module}; this run captures {capture.get('hook')}s")
    reduce = capture.get("reduce", "none")
    if reduced and reduce != probe.pooling.removeprefix("reduced_"):
        raise ToolError(f"{where} reads {probe.pooling}; run with --reduce {probe.pooling.removeprefix('reduced_')}")
    if not reduced and reduce != "none":
        raise ToolError(f"{where} reads {probe.pooling} of every row; run without --reduce")
    needs = {"mean_all": ("all",), "mean_generated": ("all", "generated")}.get(probe.pooling)
    if needs and capture.get("positions") not in needs:
        raise ToolError(f"{where} reads {probe.pooling}; run with --positions {needs[0]}")
    blocks = ((info or {}).get("presets") or {}).get(capture.get("preset") or "") or []
    layers = capture.get("layers")
    in_preset = [
        blocks[i] for i in (range(len(blocks)) if layers is None else layers) if -len(blocks) <= i < len(blocks)
    ]
    if probe.module not in capture["modules"] and probe.module not in in_preset:
        capture["modules"].append(probe.module)
    return capture


def intervention(opts: Options, vector_id: str, name: str, coeff: float) -> list[dict] | None:
    """The edit a strength adds to every job (None at 0: the unsteered reference)."""
    if coeff == 0:
        return None
    vector = {"vector_id": vector_id, "name": name}
    return [{"module": opts.at, "op": "add", "vector": vector, "coeff": coeff, "normalize": opts.normalize}]


@dataclass
class Sweep:
    """A steering run's directory and the vector set it uses (uploaded once, kept in steer/run.json)."""

    out: Path
    opts: Options
    vector: Vector
    state: dict = field(default_factory=dict)
    uploaded: str | None = None  # a set this invocation uploaded (deleted again if nothing was written)

    @property
    def state_file(self) -> Path:
        return self.out / "steer" / STATE

    def wanted(self) -> dict:
        v = self.vector
        return {
            "vectors": v.path if v.path is not None else v.vector_id,
            "sha256": v.sha256,
            "name": v.name,
            "module": self.opts.at,
            "normalize": self.opts.normalize,
        }

    def resolve(self, client: Client) -> None:
        """The vector set to use: the one a resumed run recorded, the given id (checked), or the
        file's tensor uploaded now."""
        wanted = self.wanted()
        if self.state_file.exists():
            saved = json.loads(self.state_file.read_text())
            if self.vector.path is None:
                wanted["name"] = saved["name"] if not self.opts.name else wanted["name"]
            changed = sorted(k for k in wanted if k != "vectors" and saved.get(k) != wanted[k])
            if self.vector.vector_id is not None and saved.get("vector_id") != self.vector.vector_id:
                changed.append("vector_id")
            if changed:
                raise ToolError(
                    f"{self.out} holds a steering run with other settings ({', '.join(changed)}); "
                    "use another --out to start a new one"
                )
            self.state = saved
            self.vector.vector_id, self.vector.name = saved["vector_id"], saved["name"]
            return
        if self.vector.vector_id is not None:  # a set on the server: its tensor, chosen as for a file
            record = client.vector_set(self.vector.vector_id)
            names = list(record.get("tensors") or {})
            self.vector.name = _pick(names, self.opts.name, self.opts.at, f"vector set {self.vector.vector_id}")
            self.vector.metadata = _entry(record.get("metadata"), self.vector.name)
            shape = record["tensors"][self.vector.name]["shape"]
            if len(shape) != 1:
                raise ToolError(
                    f"vector set {self.vector.vector_id}: tensor {self.vector.name!r} is {shape}; give one vector [W]"
                )
        else:
            self.vector.vector_id = self.uploaded = upload(client, self.vector)
        self.state = {**self.wanted(), "vector_id": self.vector.vector_id}

    def save_state(self) -> None:
        """steer/run.json, once the API accepted the first jobs (a BatchRun's on_save)."""
        if not self.state_file.exists():
            batch.write_json(self.state_file, self.state)
        self.uploaded = None

    def forget_upload(self, client: Client) -> None:
        """Delete the set uploaded by an invocation that wrote nothing (its jobs were refused)."""
        if self.uploaded is not None:
            try:
                client.delete_vectors(self.uploaded)
            except (httpx.HTTPError, ActqClientError):  # best effort: the refusal is what the user must see
                pass
            self.uploaded = None


def upload(client: Client, vector: Vector) -> str:
    """The chosen tensor as a vector set of its own (POST /vectors), with its metadata entry."""
    from safetensors.numpy import save

    assert vector.values is not None
    metadata = None
    if vector.metadata is not None and len(json.dumps(vector.metadata)) <= 1000:
        metadata = {vector.name: json.dumps(vector.metadata)}
    data = save({vector.name: np.ascontiguousarray(vector.values, dtype=np.float32)}, metadata=metadata)
    label = f"actq steer: {Path(vector.path or '').name}:{vector.name}"[:200]
    return str(client.upload_vectors(data, label=label)["id"])


Plan = Callable[[Path, list[dict] | None, str], batch.Planned]


def sweep(
    client: Client,
    out: Path,
    opts: Options,
    vector: Vector,
    plan: Plan,
    *,
    unit: str,
    quiet: bool,
) -> tuple[Sweep, dict[float, dict]]:
    """Run every strength (`plan(directory, interventions, coefficient label)` builds each one's
    results directory and items); returns the sweep and each strength's summary."""
    run = Sweep(Path(out), opts, vector)
    run.resolve(client)
    assert vector.vector_id is not None
    order = sorted(opts.coeffs, key=lambda c: c == 0)  # a steered strength first: a refused edit writes nothing
    plans = []
    for coeff in order:
        label = coeff_label(coeff)
        planned = plan(
            run.out / "steer" / f"coeff={label}", intervention(opts, vector.vector_id, vector.name, coeff), label
        )
        planned.run.on_save = run.save_state
        plans.append(planned)
    try:
        summaries = batch.execute_many(client, plans, unit=unit, quiet=quiet)
    except (ActqClientError, httpx.HTTPError, ToolError):  # made one line by remote.reaching
        if not any(p.run.saved for p in plans):
            run.forget_upload(client)
        raise
    return run, dict(zip(order, summaries, strict=True))


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
            views = probes.job_views(sample, "sample")
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
                rows = probes.read_file(run_dir / file, [probe.point])[probe.point]
            else:
                rows = fetch(view, probe.point)
            pooled, _ = probes.pool(
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

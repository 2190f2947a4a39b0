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

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from shared.cli import batch
from shared.cli.steer_options import (
    MAX_COEFF,
    UUID_RE,
    Options,
    ProbeMetric,
    Vector,
    capture_with_probe,
    coeff_label,
    metadata_entry,
    options,
    parse_coeff,
    pick_tensor,
    read_probe,
    read_tensor,
    read_vector,
)
from shared.cli.steer_report import (
    METRIC_TITLES,
    edited_positions,
    gsm8k_metric,
    interventions_of,
    length_metric,
    plot,
    probe_metric,
    report,
)
from shared.client import ActqClientError, Client
from shared.errors import ToolError

__all__ = [
    "MAX_COEFF",
    "METRIC_TITLES",
    "STATE",
    "UUID_RE",
    "Options",
    "Plan",
    "ProbeMetric",
    "Sweep",
    "Vector",
    "capture_with_probe",
    "coeff_label",
    "edited_positions",
    "gsm8k_metric",
    "intervention",
    "interventions_of",
    "length_metric",
    "metadata_entry",
    "options",
    "parse_coeff",
    "pick_tensor",
    "plot",
    "probe_metric",
    "read_probe",
    "read_tensor",
    "read_vector",
    "report",
    "sweep",
    "upload",
]

STATE = "run.json"  # in OUT/steer/


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
            self.vector.name = pick_tensor(names, self.opts.name, self.opts.at, f"vector set {self.vector.vector_id}")
            self.vector.metadata = metadata_entry(record.get("metadata"), self.vector.name)
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

"""A two-class probe as a direction in activation space, and the file of them that `actq probe`
writes (`probe-directions.safetensors`).

For a label of two classes, each trained probe is also fitted on all its rows and its direction
written to the file (`write_directions`): the unit vector in activation space (coef / scale,
normalized; toward the positive class, the second in sorted order), named `<point>:<pooling>`,
and `<point>` for the point's best pooling, with the `norm` and `bias` that give the probe's
score on a raw pooled activation x: `norm * (unit . x) + bias` (the pipeline's
decision_function). `actq run-file`/`gsm8k --steer` read it (shared/cli/steer_options.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

DIRECTIONS_FILE = "probe-directions.safetensors"
NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,200}$")  # a vector set's tensor names (POST /vectors)


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

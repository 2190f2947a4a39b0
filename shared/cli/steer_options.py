"""What a steering run is asked for, checked before anything talks to the API: the options
(`--steer`, `--at`, `--coeff`, `--steer-name`, `--normalize`, `--probe`), the steering vector (a
tensor of a local safetensors file, or a vector set's id) and the probe a prompt file's run is
measured with (a probe-directions.safetensors of `actq probe`), with the capture it needs."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError

from shared.cli.remote import one_line
from shared.errors import ToolError

UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MAX_COEFF = 1e4  # the API's limit on `coeff`


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


def pick_tensor(names: list[str], name: str | None, at: str, where: str) -> str:
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


def metadata_entry(metadata: dict | None, name: str) -> dict | None:
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
            chosen = pick_tensor(names, name, at, str(path))
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
    return Vector(chosen, values, metadata_entry(metadata, chosen), str(path), digest)


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

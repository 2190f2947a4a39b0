"""Interventions checked against the model a worker published: which modules an edit names, and
whether its vectors, features and steps fit them (the API refuses what does not, nothing queued)."""

from __future__ import annotations

import numpy as np

from shared.capture_spec import check_patterns, names
from shared.errors import CaptureSpecError, InterventionError
from shared.interventions import (
    MAX_EDIT_POINTS,
    MAX_INLINE_NUMBERS,
    MAX_INTERVENTIONS,
    EditPoint,
    EditPositions,
    Intervention,
)
from shared.schemas import ModelInfo


def _preset_modules(edit: Intervention, model: ModelInfo) -> list[str]:
    assert edit.preset is not None
    paths = model.presets.get(edit.preset)
    if paths is None:
        known = ", ".join(sorted(model.presets)) or "none (name modules instead)"
        raise InterventionError(f"model {model.name!r} has no preset {edit.preset!r}; its presets: {known}")
    if edit.layers is None:
        return list(paths)
    picked = []
    for layer in edit.layers:
        if not -len(paths) <= layer < len(paths):
            raise InterventionError(
                f"layer {layer} is out of range for preset {edit.preset!r} ({len(paths)} layers, 0 to {len(paths) - 1})"
            )
        picked.append(paths[layer])
    return list(dict.fromkeys(picked))


def resolve(edits: list[Intervention], model: ModelInfo, trace: bool, max_tokens: int) -> list[EditPoint]:
    """Every (edit, module) pair the edits name, checked against the model: the module exists,
    computes every position, has the hook; inline vectors have its width; features are in range;
    generated steps exist. Raises InterventionError naming the edit (`interventions[i]`)."""
    if len(edits) > MAX_INTERVENTIONS:
        raise InterventionError(f"{len(edits)} interventions in one request; at most {MAX_INTERVENTIONS}")
    inline = sum(len(v) for e in edits for _, v in e.vectors() if isinstance(v, list))
    if inline > MAX_INLINE_NUMBERS:
        raise InterventionError(
            f"{inline:,} inline vector values in one request; at most {MAX_INLINE_NUMBERS:,}: upload the vectors "
            "(POST /vectors) and name them"
        )
    points: list[EditPoint] = []
    for index, edit in enumerate(edits):
        where = f"interventions[{index}]"
        try:
            if edit.module is not None:
                modules = names(check_patterns([edit.module])[0], model)
            else:
                modules = _preset_modules(edit, model)
        except CaptureSpecError as exc:
            raise InterventionError(f"{where}: {exc.message.replace('capture path', 'module')}") from None
        _check_where(edit, where, trace, max_tokens)
        for path in modules:
            info = model.modules[model.module_index[path]]
            width = info.width(edit.hook)
            if width is None:
                raise InterventionError(
                    f"{where}: module {path!r} has no editable {edit.hook} (not one [batch, position, hidden] tensor)"
                )
            if not info.all_positions:
                raise InterventionError(
                    f"{where}: module {path!r} only computes the last position of each step; edit a module that "
                    "computes every position (a block, its norm, attention or MLP)"
                )
            for field, vector in edit.vectors():
                if isinstance(vector, list) and len(vector) != width:
                    raise InterventionError(
                        f"{where}.{field} has {len(vector)} values; module {path!r} ({edit.hook}) is {width} wide"
                    )
                if isinstance(vector, list) and field == "vector" and edit.divides_by_norm:
                    check_direction(np.asarray(vector, dtype=np.float32), f"{where}.vector", edit.op)
            try:
                edit.feature_indices(width)
            except ValueError as exc:
                raise InterventionError(f"{where}: module {path!r}: {exc}") from None
            points.append(EditPoint(index=index, module=path, hook=edit.hook, width=width))
            if len(points) > MAX_EDIT_POINTS:
                raise InterventionError(
                    f"the interventions name more than {MAX_EDIT_POINTS} (edit, module) pairs; name fewer layers"
                )
    return points


def _check_where(edit: Intervention, where: str, trace: bool, max_tokens: int) -> None:
    positions = edit.positions
    generated = positions == "generated" or (isinstance(positions, EditPositions) and positions.generated is not None)
    if trace and generated:
        raise InterventionError(
            f"{where}: a trace job generates nothing, so generated steps select nothing; edit prompt positions"
        )
    if isinstance(positions, EditPositions) and isinstance(positions.generated, list):
        for item in positions.generated:
            first = item if isinstance(item, int) else int(item.split(":")[0] or 0)
            if first >= max_tokens:
                raise InterventionError(
                    f"{where}: generated step {item!r} starts at or after max_tokens ({max_tokens}): it selects nothing"
                )


def check_direction(values: np.ndarray, where: str, op: str) -> None:
    """A vector whose direction an op uses (`project_out`, a normalized `add`) is not all zeros
    once stored as the worker holds it (float32): it has no direction to divide by."""
    if not values.any():
        raise InterventionError(
            f"{where} is all zeros (as float32): {op} {'removes' if op == 'project_out' else 'adds'} its direction, "
            "and it has none; give a non-zero vector"
        )

"""Each edit kind's op, in one place: the parameters a job's edit holds for it (made from the
request here, `make`) and the arithmetic that applies it to a value (`OPS`). Both edit paths
(worker/hooks/paths.py) apply the ops from here: the hooks (worker/hooks/edits.py), with each
parameter stacked for a group of rows (`[B, 1, W]` in the value's dtype), and the step tables
(worker/hooks/step_edits.py), with each parameter in a per-slot table (float32, cast to the
value's dtype where applied: the same numbers). The paths choose the rows and positions an op
applies to; the op only says what it makes of a value.

A new edit kind: its request shape and checks in shared/interventions.py, and its `Op` (its
parameters, `make`'s branch, its arithmetic) here; both paths then apply it. Patch is the one kind
outside: its values are the source job's rows at each position, not a per-row parameter, so the
hooks alone apply it (edits.py `_patch_values`) and the tables never hold it (`step_edits.fits`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.errors import JobFailure

if TYPE_CHECKING:
    from shared.interventions import Intervention
    from worker.hooks.edits import RowEdit


@dataclass(frozen=True)
class Param:
    """One parameter of an op, per row: the `RowEdit` field of that name. `features`: one value per
    feature (`[W]`), else one number; `boolean`: a mask, else numbers in the value's dtype; `fill`:
    what a row that takes no edit holds."""

    fill: float | bool
    features: bool = True
    boolean: bool = False

    def of(self, edit: RowEdit, name: str) -> torch.Tensor:
        """The row's value of this parameter, `[W]` or `[1]` (float32, or bool)."""
        value = getattr(edit, name)
        if not self.features:
            return torch.tensor([float(value)], dtype=torch.float32)
        assert isinstance(value, torch.Tensor), f"{edit.kind} edit without its {name}"
        return value


PARAMS = {
    "vector": Param(0.0),  # add: coeff * v (normalized add: coeff * v / |v|); project_out: v / |v|
    "factor": Param(1.0),  # scale: the factor on its features, 1 elsewhere
    "zeroed": Param(False, boolean=True),  # zero: True on its features
    "value": Param(0.0, features=False),  # project_out: the component left along the direction
}


@dataclass(frozen=True)
class Op:
    """An edit kind's arithmetic: `apply(x, params)` with `x` `[B, S, W]` and each of `params`
    (`PARAMS` names) broadcast to it, `[B, 1, W]` or `[B, 1, 1]`. `folds`: a row holding every
    parameter's `fill` keeps its value exactly whatever it is (x + 0, x * 1, no fill), so a pass may
    fold which rows take the op into its parameters and apply it to every row; not an op whose
    arithmetic on an inf would turn that row's value into NaN."""

    params: tuple[str, ...]
    apply: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    folds: bool = False


def _add(x: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return x + p["vector"]


def _add_norm(x: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return x + p["vector"] * torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _scale(x: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return x * p["factor"]


def _zero(x: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return x.masked_fill(p["zeroed"], 0)


def _project_out(x: torch.Tensor, p: Mapping[str, torch.Tensor]) -> torch.Tensor:
    along = (x * p["vector"]).sum(-1, keepdim=True)
    return x - (along - p["value"]) * p["vector"]


OPS: dict[str, Op] = {
    "add": Op(("vector",), _add, folds=True),
    "add_norm": Op(("vector",), _add_norm),
    "scale": Op(("factor",), _scale, folds=True),
    "zero": Op(("zeroed",), _zero, folds=True),
    "project_out": Op(("vector", "value"), _project_out),
}


def unit(values: torch.Tensor, what: str) -> torch.Tensor:
    """`values` over its norm. Values so small that their float32 squares underflow still have a
    direction, taken in float64: the API refuses only all zeros (intervention_check.check_direction)."""
    norm = torch.linalg.vector_norm(values)
    if float(norm) != 0.0:
        return values / norm
    if not bool(values.any()):
        raise JobFailure(f"{what} is all zeros: it has no direction")
    wide = values.double()
    return (wide / torch.linalg.vector_norm(wide)).to(values.dtype)


def make(
    row: RowEdit,
    edit: Intervention,
    width: int,
    vector: Callable[[str], torch.Tensor],  # a field's vector, [width] float32 on the device
    device: torch.device | str,
    where: str,
) -> None:
    """`row`'s parameters for the request's `edit` (an op of `OPS`; `row.kind` then names it)."""
    if edit.op == "add":
        values = vector("vector")
        row.normalize = edit.normalize
        row.vector = edit.coeff * (unit(values, f"{where}: the vector") if edit.normalize else values)
    elif edit.op == "project_out":
        row.vector = unit(vector("vector"), f"{where}: the direction")
        row.value = edit.value or 0.0
    elif edit.op in ("scale", "zero"):
        features = edit.feature_indices(width)
        chosen = torch.zeros(width, dtype=torch.bool, device=device)
        chosen[features if features is not None else slice(None)] = True
        if edit.op == "scale":
            assert edit.factor is not None
            row.factor = torch.where(chosen, edit.factor, 1.0).to(torch.float32)
        else:
            row.zeroed = chosen
    else:
        raise AssertionError(f"no op for edits of kind {edit.op!r}")

"""Interventions: edits a job declares (`add`, `scale`, `zero`, `project_out`, `patch`), their
request shape, and their checks against the model a worker published (docs/interventions.md).

An edit is data, never code: a module named with the capture grammar (shared/capture_spec.py) or
a preset, which side of it (`output` or `input`), one operation with numbers, vectors given
inline or by reference (a row or the mean of rows of an earlier job's captured tensor, or a
tensor of an uploaded vector set), where it applies (prompt positions and generated steps), and
optionally a gate (a linear probe on the same activation that decides, position by position,
whether the edit applies). Nothing here looks anything up by a request's text but the published
module list.

Where an edit applies, in the positions of the tokens fed to the model (as `capture`'s): a
P-token prompt is positions 0 to P - 1; generated step k (k from 0) is the forward step that
chooses new token k, at position P - 1 + k (step 0 is the prompt's last position; step k >= 1
feeds new token k - 1). So `"generated"` is exactly the rows a capture at `generated` keeps.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

Op = Literal["add", "scale", "zero", "project_out", "patch"]
Hook = Literal["output", "input"]  # shared.schemas re-exports it (capture and edits name hooks alike)


class Strict(BaseModel):
    """Unknown fields are an error (as shared.schemas.Strict, which this module cannot import)."""

    model_config = ConfigDict(extra="forbid")


MAX_INTERVENTIONS = 64  # edits in one request
MAX_EDIT_POINTS = 512  # (edit, module) pairs once patterns and presets are expanded
MAX_VECTOR_WIDTH = 65_536
MAX_INLINE_NUMBERS = 1_048_576  # inline vector values in one request, all edits together
MAX_SELECTORS = 256  # indices and windows in one positions list
MAX_COEFF = 1e4  # |coeff|, |factor|, |value|, |bias|, |above|, |below|
MAX_VECTOR_VALUE = 1e6  # |each inline vector value|
_WINDOW = re.compile(r"(-?[0-9]{1,7})?:(-?[0-9]{1,7})?")  # ASCII digits only, matched whole
_UUID = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
_TENSOR_NAME = r"^[A-Za-z0-9_.:/-]{1,300}$"


_SLICE = re.compile(r"([0-9]{1,7}):([0-9]{1,7})")


def check_features(value: str | list[int] | None) -> str | list[int] | None:
    """`features` as a request writes them (capture and edits alike): a slice "a:b" with a < b,
    or indices that do not repeat."""
    if isinstance(value, str):
        match = _SLICE.fullmatch(value)
        if match is None or int(match.group(1)) >= int(match.group(2)):
            raise ValueError(f'a feature slice is "a:b" with 0 <= a < b (e.g. "0:64"), not {value!r}')
    elif isinstance(value, list) and len(set(value)) != len(value):
        raise ValueError("feature indices must not repeat")
    return value


def feature_indices(features: str | list[int] | None, width: int) -> list[int] | None:
    """The indices `features` names in a `width`-wide value (None: all); ValueError when out of range."""
    if features is None:
        return None
    if isinstance(features, str):
        lo, hi = (int(x) for x in features.split(":"))
        if hi > width:
            raise ValueError(f'features "{features}" ends past the width {width} (at most "{lo}:{width}")')
        return list(range(lo, hi))
    over = [i for i in features if i >= width]
    if over:
        raise ValueError(f"feature indices {over[:5]} are out of range for the width {width} (0 to {width - 1})")
    return list(features)


def _finite(value: float, limit: float, what: str) -> float:
    if not math.isfinite(value) or abs(value) > limit:
        raise ValueError(f"{what} must be a finite number of magnitude at most {limit:g}, not {value!r}")
    return value


class JobVector(Strict):
    """A vector from an earlier job's captured tensor: one row (`row`, negative from the end) or
    the mean of its rows (`mean: true`). The job must be the caller's, of the same model, and
    have captured the tensor at the module's full width."""

    job: Annotated[str, Field(pattern=_UUID)]
    tensor: Annotated[str, Field(pattern=_TENSOR_NAME)]
    row: Annotated[int, Field(ge=-10_000_000, lt=10_000_000)] | None = None
    mean: StrictBool = False

    @model_validator(mode="after")
    def _one_row(self) -> JobVector:
        if (self.row is None) == (not self.mean):
            raise ValueError("a job vector takes one row (`row`, e.g. -1 for the last) or `mean: true`, not both")
        return self


class SetVector(Strict):
    """A tensor of an uploaded vector set (`POST /vectors`): `[W]`, or one row of `[n, W]`."""

    vector_id: Annotated[str, Field(pattern=_UUID)]
    name: Annotated[str, Field(pattern=_TENSOR_NAME)]
    row: Annotated[int, Field(ge=-10_000_000, lt=10_000_000)] | None = None


Vector = Annotated[list[float], Field(min_length=1, max_length=MAX_VECTOR_WIDTH)] | JobVector | SetVector


def _check_inline(vector: object, what: str) -> None:
    if isinstance(vector, list):
        bad = [i for i, v in enumerate(vector) if not math.isfinite(v) or abs(v) > MAX_VECTOR_VALUE]
        if bad:
            raise ValueError(
                f"{what} has {len(bad)} values that are not finite numbers of magnitude at most "
                f"{MAX_VECTOR_VALUE:g} (first at index {bad[0]}: {vector[bad[0]]!r})"
            )


class Gate(Strict):
    """Gated steering: the edit applies at a position only where the probe's score on the module's
    value there, `probe . x + bias`, is above `above` (or below `below`)."""

    probe: Vector
    bias: float = 0.0
    above: float | None = None
    below: float | None = None

    @field_validator("bias", "above", "below")
    @classmethod
    def _numbers(cls, value: float | None) -> float | None:
        return None if value is None else _finite(value, MAX_COEFF, "a gate's bias and threshold")

    @model_validator(mode="after")
    def _one_threshold(self) -> Gate:
        if (self.above is None) == (self.below is None):
            raise ValueError("a gate takes one threshold: `above` (apply where the score is above it) or `below`")
        _check_inline(self.probe, "the gate's probe")
        return self


class PatchSource(Strict):
    """Where `patch` takes its values: an earlier job's captured tensor (the caller's, same model,
    same module and hook, every feature, not reduced). The row for token position p replaces
    the value at position p: positions must fall inside the rows that job kept."""

    job: Annotated[str, Field(pattern=_UUID)]
    tensor: Annotated[str, Field(pattern=_TENSOR_NAME)]


Selector = Annotated[int, Field(ge=-10_000_000, lt=10_000_000)] | Annotated[str, Field(max_length=20)]


def _check_selectors(value: object) -> object:
    if isinstance(value, list):
        if not value:
            raise ValueError('a positions list selects at least one index or window (or use "all")')
        for item in value:
            if isinstance(item, str) and not _WINDOW.fullmatch(item):
                raise ValueError(
                    f'a window is "a:b" (either end may be left out, negative counts from the end), not {item!r}'
                )
    return value


class EditPositions(Strict):
    """Prompt positions (indices, negative from the prompt's end, and windows "a:b" as in Python)
    and generated steps (indices from 0 and windows: ":8" is the first 8); either may be left out."""

    prompt: Literal["all"] | Annotated[list[Selector], Field(max_length=MAX_SELECTORS)] | None = None
    generated: Literal["all"] | Annotated[list[Selector], Field(max_length=MAX_SELECTORS)] | None = None

    @field_validator("prompt", "generated", mode="before")
    @classmethod
    def _one_as_list(cls, value: object) -> object:
        # one index or window stands for a list of it: {"generated": ":8"}, {"prompt": -1}
        return [value] if isinstance(value, int) or (isinstance(value, str) and value != "all") else value

    @field_validator("prompt", "generated")
    @classmethod
    def _windows(cls, value: object) -> object:
        return _check_selectors(value)

    @field_validator("generated")
    @classmethod
    def _steps_count_forward(cls, value: object) -> object:
        if isinstance(value, list):
            for item in value:
                if (isinstance(item, int) and item < 0) or (isinstance(item, str) and "-" in item):
                    raise ValueError(
                        f"generated steps count from 0 (the step that chooses the first new token); {item!r} "
                        "counts from an end the job does not know in advance"
                    )
        return value

    @model_validator(mode="after")
    def _something(self) -> EditPositions:
        if self.prompt is None and self.generated is None:
            raise ValueError('name `prompt` positions, `generated` steps, or both (or use "all")')
        return self


Features = (
    Annotated[str, Field(max_length=20)]
    | Annotated[list[Annotated[int, Field(ge=0, lt=10_000_000)]], Field(min_length=1, max_length=MAX_VECTOR_WIDTH)]
)

_PARAMS: dict[str, tuple[set[str], set[str]]] = {  # op -> (required, allowed) fields besides the common ones
    "add": ({"vector"}, {"vector", "coeff", "normalize"}),
    "scale": ({"factor"}, {"factor", "features"}),
    "zero": (set(), {"features"}),
    "project_out": ({"vector"}, {"vector", "value"}),
    "patch": ({"source"}, {"source"}),
}
_OPTIONAL = {"vector", "coeff", "normalize", "factor", "features", "value", "source"}


class Intervention(Strict):
    """One edit (docs/interventions.md). `module` is a capture path pattern (one edit may name
    several modules: `model.layers.{3,6,9}`), or `preset` with `layers`."""

    module: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    preset: Annotated[str, Field(pattern=r"^[a-z][a-z_]{0,31}$")] | None = None
    layers: (
        Annotated[list[Annotated[int, Field(ge=-100_000, le=100_000)]], Field(min_length=1, max_length=4096)] | None
    ) = None
    hook: Hook = "output"
    op: Op
    positions: Literal["all", "prompt", "generated"] | EditPositions = "all"
    vector: Vector | None = None
    coeff: float = 1.0
    normalize: StrictBool = False
    factor: float | None = None
    features: Features | None = None
    value: float | None = None
    source: PatchSource | None = None
    when: Gate | None = None

    @field_validator("coeff", "factor", "value")
    @classmethod
    def _numbers(cls, value: float | None) -> float | None:
        return None if value is None else _finite(value, MAX_COEFF, "coeff, factor and value")

    @field_validator("features")
    @classmethod
    def _feature_syntax(cls, value: str | list[int] | None) -> str | list[int] | None:
        return check_features(value)

    @model_validator(mode="after")
    def _shape(self) -> Intervention:
        if (self.module is None) == (self.preset is None):
            raise ValueError(
                'name the module to edit: `module` (a path, e.g. "model.layers.10") or a `preset` with `layers`'
            )
        if self.layers is not None and self.preset is None:
            raise ValueError("`layers` picks the blocks of a `preset`")
        required, allowed = _PARAMS[self.op]
        # a field at its default counts as not given (a stored record repeats every default)
        given = {f for f in _OPTIONAL if self.__dict__[f] != type(self).model_fields[f].default}
        missing = required - given
        if missing:
            raise ValueError(f"op {self.op!r} needs {', '.join(sorted(missing))}")
        extra = given - allowed
        if extra:
            takes = ", ".join(sorted(allowed)) or "nothing more"
            raise ValueError(f"op {self.op!r} takes no {', '.join(sorted(extra))} (it takes {takes})")
        if self.op == "patch" and self.when is not None:
            raise ValueError("a patch cannot be gated (`when`): patch the positions you mean")
        _check_inline(self.vector, "the vector")
        return self

    def feature_indices(self, width: int) -> list[int] | None:
        """The features a `scale` or `zero` touches (None: all); ValueError when out of range."""
        return feature_indices(self.features, width)

    @property
    def divides_by_norm(self) -> bool:
        """Whether the op uses its vector's direction (`project_out`, a normalized `add`): an
        all-zero vector has none, and is refused at submit (the worker checks again)."""
        return self.op == "project_out" or (self.op == "add" and self.normalize)

    def vectors(self) -> list[tuple[str, Vector]]:
        """(field, vector) for every vector this edit names: the op's and the gate's probe."""
        found: list[tuple[str, Vector]] = []
        if self.vector is not None:
            found.append(("vector", self.vector))
        if self.when is not None:
            found.append(("when.probe", self.when.probe))
        return found


class EditPoint(Strict):
    """One edit at one module, resolved by the API against the published model: what the worker
    applies (`index` is the edit's place in the request's `interventions`)."""

    index: int
    module: str
    hook: Hook
    width: int


class EditReport(Strict):
    """`result.interventions` entry: how many positions one edit touched at one module, per
    forward step (`applied[k]`: step k, where step 0 is the prompt's pass and step k >= 1 feeds
    new token k - 1; a trace job has one step). A gated edit counts the positions it fired at."""

    index: int
    module: str
    hook: Hook
    op: Op
    applied: list[int]
    total: int


def _window(item: int | str, length: int) -> tuple[int, int]:
    """An index or "a:b" window over `length` items, as Python indexes a list (negative from the
    end); an index out of range is an error, a window is clipped."""
    if isinstance(item, int):
        at = item + length if item < 0 else item
        if not 0 <= at < length:
            raise ValueError(f"index {item} is out of range for {length} positions")
        return at, at + 1
    lo, hi = item.split(":")
    start, stop, _ = slice(int(lo) if lo else None, int(hi) if hi else None).indices(length)
    return start, max(start, stop)


def intervals(
    positions: Literal["all", "prompt", "generated"] | EditPositions, prompt_tokens: int, new_tokens: int
) -> list[tuple[int, int]]:
    """The token positions an edit applies to, as sorted disjoint `[lo, hi)` ranges, for a
    P-token prompt and at most N new tokens (a trace: N = 0). Raises ValueError for a prompt
    index the prompt does not have."""
    prompt, steps = prompt_tokens, new_tokens
    found: list[tuple[int, int]] = []
    if positions == "all":
        found.append((0, prompt + max(steps - 1, 0)))
    elif positions == "prompt":
        found.append((0, prompt))
    elif positions == "generated":
        found.append((prompt - 1, prompt - 1 + steps))
    else:
        if positions.prompt == "all":
            found.append((0, prompt))
        elif positions.prompt is not None:
            found += [_window(item, prompt) for item in positions.prompt]
        if positions.generated == "all":
            found.append((prompt - 1, prompt - 1 + steps))
        elif positions.generated is not None:
            for item in positions.generated:
                if isinstance(item, int) and item >= steps:
                    continue  # a step the job never reaches
                lo, hi = _window(item, steps) if not isinstance(item, int) else (item, item + 1)
                found.append((prompt - 1 + lo, prompt - 1 + hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in found if r[1] > r[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged

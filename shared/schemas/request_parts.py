"""The parts a job request is built of: a chat turn (`ChatMessage`), what to capture
(`CaptureSpec`) and the trusted code an nnsight job runs (`NnsightCall`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    field_validator,
    model_serializer,
    model_validator,
)

from shared.dtypes import CaptureDtype
from shared.interventions import Hook, check_features, feature_indices
from shared.schemas.base import Positions, Reduce, Strict
from shared.schemas.request_limits import MAX_CAPTURE_PATTERNS, MAX_FEATURES, MAX_MESSAGE_CHARS
from shared.tools import CALL_ID_PATTERN, MAX_TOOL_CALLS, ToolCall


class ChatMessage(Strict):
    """One turn. `content` is required but for an assistant turn that makes `tool_calls`; a
    `tool` turn answers one of those calls (`tool_call_id`) with its result as content."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: Annotated[str, Field(pattern=CALL_ID_PATTERN)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role} one")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError(
                "a tool message needs `tool_call_id` (the id of the call it answers)"
                if self.role == "tool"
                else f"tool_call_id belongs to a tool message, not a {self.role} one"
            )
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs `content` (a string)")
        return self

    @property
    def text(self) -> str:
        return self.content or ""

    @model_serializer(mode="wrap")
    def _without_unset_tool_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A plain turn stays `{"role", "content"}` in stored requests and answers."""
        out: dict[str, Any] = handler(self)
        for key in ("tool_calls", "tool_call_id"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class CaptureSpec(Strict):
    """Which activations to keep: module path patterns, a preset, or both (docs/capture.md)."""

    modules: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_CAPTURE_PATTERNS)
    ] = []
    # A named module set the model publishes (GET /models: residual, attention, mlp), one module
    # per decoder block; `layers` picks blocks by index (negative counts from the last), default all.
    preset: Annotated[str, Field(pattern=r"^[a-z][a-z_]{0,31}$")] | None = None
    layers: (
        Annotated[list[Annotated[int, Field(ge=-100_000, le=100_000)]], Field(min_length=1, max_length=4096)] | None
    ) = None
    hook: Hook = "output"
    positions: Positions = "all"
    dtype: CaptureDtype = "float32"
    # Server-side reduction over the selected positions: one row per capture point instead of one
    # per position ("none" keeps every row). `features` keeps part of the last dimension: a slice
    # "a:b" (a included, b excluded) or a list of indices, in the order given.
    reduce: Reduce = "none"
    features: (
        Annotated[str, Field(max_length=20)]
        | Annotated[list[Annotated[int, Field(ge=0, lt=10_000_000)]], Field(min_length=1, max_length=MAX_FEATURES)]
        | None
    ) = None

    @field_validator("features")
    @classmethod
    def _feature_syntax(cls, value: str | list[int] | None) -> str | list[int] | None:
        return check_features(value)

    def feature_indices(self, width: int) -> list[int] | None:
        """The kept indices of a `width`-wide value (None: all); raises ValueError when out of range."""
        return feature_indices(self.features, width)

    @model_validator(mode="after")
    def _names_something(self) -> CaptureSpec:
        if not self.modules and self.preset is None:
            raise ValueError('name what to capture: `modules` (path patterns) or a `preset` (e.g. "residual")')
        if self.layers is not None and self.preset is None:
            raise ValueError("`layers` picks the blocks of a `preset`; give a preset, or use index sets in `modules`")
        return self


class NnsightCall(Strict):
    """What an nnsight job runs: a payload that nnsight's 0.8 client built (a trace's code and the
    values it uses, serialized), stored as opaque bytes in the job's storage. The API never reads
    it; the worker loads and runs it (docs/nnsight.md)."""

    model_key: Annotated[str, Field(min_length=1, max_length=2000)]  # as the client sent it
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Annotated[int, Field(ge=1)]
    compress: StrictBool = False  # the payload is zstd-compressed, and so is the result
    nnsight_version: Annotated[str, Field(max_length=100)]
    python_version: Annotated[str, Field(max_length=300)]
    session_id: Annotated[str, Field(max_length=100)] | None = None  # the WebSocket that hears its statuses
    caller: Annotated[str, Field(max_length=100)] | None = None  # the sending key's id

"""The base every request and response shape derives from (unknown fields refused), and the
literal types several of them share: capture positions and reductions, job modes, finish reasons."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Positions = Literal["all", "prompt", "generated", "last", "completion"]
Reduce = Literal["none", "mean", "sum", "max", "last"]
Mode = Literal["generate", "trace", "nnsight"]
FinishReason = Literal["stop", "length", "tool_calls", "cancelled", "timeout"]


class Strict(BaseModel):
    """Unknown fields are an error: a typo must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")

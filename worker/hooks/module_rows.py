"""A module's value read as rows of positions: the one tensor of a module's output or input, and
that tensor as each sequence's `[S, W]` rows (a prefill pass) or the batch's `[B, W]` rows (a
decoding step). Every capture and edit path reads values through these.

Shapes seen across architectures: `[B, S, H]`; `[B, S, heads, D]` (Qwen3's q_norm); `[B * S, H]`
(OPT's MLP and per-layer norm flatten the batch away); and at a decoding step `[B, 1, H]`.
"""

from __future__ import annotations

import torch


def first_tensor(value: object) -> torch.Tensor | None:
    """A module's value: one tensor, or the first element of a tuple when that is a tensor (the
    transformers convention: `(hidden_states, attention_weights, ...)`; a `ModelOutput` counts as
    the tuple of its fields, `last_hidden_state` first) and no other element is a tensor of its
    shape (rotary embeddings return `(cos, sin)`: no one value)."""
    if isinstance(value, torch.Tensor):
        return value
    if callable(getattr(value, "to_tuple", None)):  # a transformers ModelOutput: its fields in order
        value = value.to_tuple()  # type: ignore[attr-defined]  # checked just above
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        first = value[0]
        if not any(isinstance(v, torch.Tensor) and v.shape == first.shape for v in value[1:]):
            return first
    return None


def first_input(args: tuple, kwargs: dict) -> object:
    """What a module's `input` is: its first positional argument, or its first keyword argument
    when it was called with keywords only (decoder layers get `hidden_states=` in transformers 5)."""
    if args:
        return args[0]
    return next(iter(kwargs.values()), None)


def rows_of(value: torch.Tensor) -> torch.Tensor | None:
    """A per-position value as `[S, W]`: `[1, S, H]` loses its batch dim, `[1, S, heads, D]`
    (Qwen3's q_norm) also flattens its trailing dims, and `[S, H]` (OPT's MLP and per-layer norm
    flatten the batch away) is already rows; None for any other shape."""
    if value.dim() >= 3 and value.shape[0] == 1:
        return value[0] if value.dim() == 3 else value[0].flatten(1)
    if value.dim() == 2:
        return value
    return None


def split_rows(value: torch.Tensor | None, batch: int) -> list[torch.Tensor | None]:
    """A module's value for a batch of `batch` sequences, as each sequence's `[S, W]` rows:
    `[B, S, H]` and `[B, S, heads, D]` split on the batch dim; a 2-D `[B * S, H]` (OPT's MLP and
    per-layer norm flatten the batch) splits into B equal runs of rows."""
    if value is None:
        return [None] * batch
    if value.dim() >= 3 and value.shape[0] == batch:
        return [rows_of(value[b : b + 1]) for b in range(batch)]
    if value.dim() == 2 and value.shape[0] % batch == 0:
        return list(value.view(batch, value.shape[0] // batch, value.shape[1]).unbind(0))
    return [None] * batch


def step_rows(value: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """A module's value at a decoding step (one new position per sequence) as `[B, W]`: `[B, 1, H]`,
    `[B, 1, heads, D]` and `[B, H]` (OPT's flattened batch); None for any other shape."""
    if value is None or value.shape[0] != batch:
        return None
    if value.dim() >= 3 and value.shape[1] == 1:
        return value.reshape(batch, -1)
    if value.dim() == 2:
        return value
    return None

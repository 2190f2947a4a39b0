"""The KV cache of the persistent batch: preallocated, one slot per running sequence.

Each attention layer has keys and values `[slots, kv_heads, slot_tokens, head_dim]` allocated
once. A sequence owns a slot from its join to its end: its prompt's keys and values are copied
into positions [0, P) of the slot after its prefill (`write`), and every decoding step writes
each row's new key and value at that row's own position (`update`, a `scatter_` with the
step's position buffer) and attends over the first `span` positions of the rows [0, B) it runs
(`SlotCache.prepare`; a view, never a copy). Position i of a slot is token i of its sequence:
no padding, nothing is ever moved, compacted or concatenated, and every tensor keeps its address
for the life of the engine (what a CUDA graph needs).

The model sees this object as its `past_key_values`: transformers' attention layers call
`update(key, value, layer_idx)` and attend over what it returns, with the 4-D mask the model
runner passes (a 4-D mask is used as given). Whether a model works this way is not read from
its class but measured (`check`): a few decoding steps through the slots must give the logits of
the same steps through transformers' own `DynamicCache`. Caches with sliding windows, state-space
or linear-attention layers are refused by name first (`unsupported`): those models keep the
compacting decoder (worker/decoding.py) or the solo decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from worker import kvcache


def unsupported(config: object) -> str | None:
    """Why this model's cache cannot live in slots, read from its cache's layer kinds (None: it
    may; `check` then measures it)."""
    cache = kvcache.new_cache(config)
    if type(cache) is not DynamicCache:
        return f"its cache is a {type(cache).__name__}"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        return "its cache has " + ", ".join(sorted(kinds)) + " layers (slots hold full-attention layers only)"
    return None


class SlotCache:
    """Keys and values of every slot, per layer (None for a layer that keeps no cache: KV sharing).
    `prepare(rows, span, positions)` sets what the next forward pass writes and reads."""

    is_compileable = False  # transformers asks; nothing here is its static cache

    def __init__(self, shapes: list[tuple[int, int] | None], slots: int, slot_tokens: int, dtype, device) -> None:
        self.slots, self.slot_tokens = slots, slot_tokens
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        for shape in shapes:
            if shape is None:
                self.keys.append(None)
                self.values.append(None)
                continue
            heads, dim = shape
            self.keys.append(torch.zeros(slots, heads, slot_tokens, dim, dtype=dtype, device=device))
            self.values.append(torch.zeros(slots, heads, slot_tokens, dim, dtype=dtype, device=device))
        self.rows, self.span = 0, 0
        self.positions: torch.Tensor | None = None

    @classmethod
    def like(cls, prefilled: DynamicCache, slots: int, slot_tokens: int) -> SlotCache:
        """Slots shaped as the layers of a cache a forward pass filled (heads, head size, dtype)."""
        shapes: list[tuple[int, int] | None] = []
        dtype = device = None
        layer: Any
        for layer in prefilled.layers:
            if not getattr(layer, "is_initialized", False):
                shapes.append(None)
                continue
            shapes.append((int(layer.keys.shape[1]), int(layer.keys.shape[3])))
            dtype, device = layer.keys.dtype, layer.keys.device
        if dtype is None:
            raise ValueError("the model's forward pass filled no cache layer")
        return cls(shapes, slots, slot_tokens, dtype, device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.keys + self.values if t is not None]

    # -- what a decoding step does ---------------------------------------------------------

    def prepare(self, rows: int, span: int, positions: torch.Tensor) -> None:
        """The next pass runs slots [0, rows), each writing at `positions[b]` (`[rows]` int64 on
        the cache's device) and attending over positions [0, span)."""
        if not 0 < span <= self.slot_tokens or not 0 < rows <= self.slots:
            fits = f"{self.slots} slots of {self.slot_tokens}"
            raise ValueError(f"a pass of {rows} rows over {span} positions does not fit {fits}")
        self.rows, self.span, self.positions = rows, span, positions

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: Any, **__: Any):
        """transformers' cache interface: store one new position per row, return what to attend."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        assert keys is not None and values is not None and self.positions is not None
        rows, heads, new, dim = key.shape
        if new != 1 or rows != self.rows:
            raise ValueError(f"slots take one position per row of the prepared {self.rows}, got {list(key.shape)}")
        index = self.positions.view(rows, 1, 1, 1).expand(rows, heads, 1, dim)
        keys[:rows].scatter_(2, index, key.to(keys.dtype))
        values[:rows].scatter_(2, index, value.to(values.dtype))
        return keys[:rows, :, : self.span], values[:rows, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span

    # -- joining ---------------------------------------------------------------------------

    def write(self, slot: int, prefilled: DynamicCache, row: int, first: int, length: int) -> None:
        """Positions [first, first + length) of row `row` of a prefill's cache (a left-padded pass:
        `first` is the row's padding) into positions [0, length) of `slot`."""
        if length > self.slot_tokens:
            raise ValueError(f"{length} positions do not fit a slot of {self.slot_tokens}")
        layer: Any
        for index, layer in enumerate(prefilled.layers):
            keys, values = self.keys[index], self.values[index]
            if keys is None or values is None or not getattr(layer, "is_initialized", False):
                continue
            keys[slot, :, :length].copy_(layer.keys[row, :, first : first + length])
            values[slot, :, :length].copy_(layer.values[row, :, first : first + length])


def causal_mask(positions: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask `[B, 1, 1, span]` of a decoding step: row b sees positions [0, positions[b]]
    (its own tokens, the new one included) and nothing after."""
    rows = positions.shape[0]
    columns = torch.arange(span, device=positions.device)
    blocked = columns.view(1, span) > positions.view(rows, 1)
    return (blocked.to(dtype) * torch.finfo(dtype).min).view(rows, 1, 1, span)

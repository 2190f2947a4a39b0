"""The KV cache of the persistent batch: preallocated, one slot per running sequence.

Each attention layer has keys and values `[slots, kv_heads, slot_tokens, head_dim]` allocated
once. A sequence owns a slot from its join to its end: its prompt's keys and values are copied
into positions [0, P) of the slot after its prefill (`write`), and every decoding step writes
each row's new key and value at that row's own position (`update`, a `scatter_` with the
step's position buffer) and attends over the first `span` positions of the rows [0, B) it runs
(`SlotCache.prepare`; views, never a copy). Position i of a slot is token i of its sequence:
no padding, nothing is ever moved, compacted or concatenated, and every tensor keeps its address
from one resize to the next (what a CUDA graph needs). A resize (`resized`: more slots or longer
ones when a sequence joins, fewer or shorter when the long rows have left; worker/batch/slot_decoding.py
decides) makes new tensors with every kept slot's kept positions copied exactly, and the graphs
that read the old ones are dropped (worker/model/runner.py `use_cache`).

The model sees this object as its `past_key_values`: transformers' attention layers call
`update(key, value, layer_idx)` and attend over what it returns, with the 4-D mask the model
runner passes (a 4-D mask is used as given; tests/worker/test_slots.py decodes each architecture
of the matrix this way against `generate`). A sliding-window layer (Mistral's, Gemma 2's and 3's
local layers) holds a ring of its window per slot, as transformers' sliding cache holds only the
window: position p at entry p % window, so the step attends over the ring's entries, the last
`window` positions once a row passed its window (`attention_mask` masks a ring's entries a row
has not reached yet), and a prefill's sliding layer, which kept its last window - 1 positions,
writes those into their entries (`write`). Other cache kinds (state-space, linear attention, chunked attention) are
refused by name (`unsupported`): those models take the state slots, the compacting decoder
(worker/batch/decoding.py) or the solo decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from worker.model import kvcache

LAYER_TYPES = {"full_attention", "sliding_attention"}  # the names of a mixed model's masks


def slides(config: object) -> bool:
    """Whether some attention layer of this model slides over a window (its slots' steps then sum
    over a ring of the window, in another order than `generate`: not bit for bit)."""
    return any(type(layer) is DynamicSlidingWindowLayer for layer in kvcache.new_cache(config).layers)


def unsupported(config: object) -> str | None:
    """Why this model's cache cannot live in slots, read from its cache's layer kinds (None: it
    may). Slots hold full-attention layers and sliding-window ones of one window (every position
    kept, the window in the step's mask, `attention_mask`); a model with both names its layers'
    kinds as transformers' mask mapping does (`layer_types`)."""
    cache = kvcache.new_cache(config)
    if type(cache) is not DynamicCache:
        return f"its cache is a {type(cache).__name__}"
    held = (DynamicLayer, DynamicSlidingWindowLayer)
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) not in held}
    if kinds:
        return "its cache has " + ", ".join(sorted(kinds)) + " layers (slots hold full and sliding-window attention)"
    windows = {layer.sliding_window for layer in cache.layers if type(layer) is DynamicSlidingWindowLayer}
    if len(windows) > 1:
        return f"its layers slide over {len(windows)} different windows"
    mixed = windows and any(type(layer) is DynamicLayer for layer in cache.layers)
    if mixed and not set(getattr(config, "layer_types", None) or ()) <= LAYER_TYPES:
        return "its sliding and full attention layers are not named as transformers' mask mapping names them"
    return None


class SlotCache:
    """Keys and values of every slot, per layer (None for a layer that keeps no cache: KV sharing).
    `prepare(part, span, positions)` sets what the next forward pass writes and reads."""

    is_compileable = False  # transformers asks; nothing here is its static cache

    def __init__(
        self,
        shapes: list[tuple[tuple[int, int], tuple[int, int], torch.device] | None],
        slots: int,
        slot_tokens: int,
        dtype,
        windows: list[int | None] | None = None,
    ) -> None:
        self.slots, self.slot_tokens = slots, slot_tokens
        # per layer: its sliding window (None: full attention, or no cache), whose slots are rings
        self.windows: list[int | None] = windows if windows is not None else [None] * len(shapes)
        self.window = next((window for window in self.windows if window is not None), None)  # one, or None
        # whether full-attention layers sit beside the sliding ones (a mask per kind)
        self.mixed = self.window is not None and any(
            window is None for window, shape in zip(self.windows, shapes, strict=True) if shape is not None
        )
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        for shape, window in zip(shapes, self.windows, strict=True):
            if shape is None:
                self.keys.append(None)
                self.values.append(None)
                continue
            (key_heads, key_dim), (value_heads, value_dim), device = shape  # MLA: values narrower than keys
            room = self._room(window, slot_tokens)
            self.keys.append(torch.zeros(slots, key_heads, room, key_dim, dtype=dtype, device=device))
            self.values.append(torch.zeros(slots, value_heads, room, value_dim, dtype=dtype, device=device))
        self.part, self.span = slice(0, 0), 0
        self.positions: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None  # a sliding layer's entries the step writes: positions % window

    @staticmethod
    def _room(window: int | None, slot_tokens: int) -> int:
        """Positions a layer's slot holds: every one, or a sliding layer's ring of its window."""
        return slot_tokens if window is None else min(window, slot_tokens)

    @classmethod
    def like(cls, prefilled: DynamicCache, slots: int, slot_tokens: int) -> SlotCache:
        """Slots shaped as the layers of a cache a forward pass filled (heads, head size, dtype,
        device: a model spread over devices keeps each layer's slots beside it)."""
        shapes, dtype = _layer_shapes(prefilled)
        windows = [getattr(layer, "sliding_window", None) for layer in prefilled.layers]
        return cls(shapes, slots, slot_tokens, dtype, windows)

    def resized(self, slots: int, slot_tokens: int) -> SlotCache:
        """This cache with `slots` slots of `slot_tokens` positions, more or fewer of either: new
        tensors, new addresses. What the first min(slots) slots hold at their first min(slot_tokens)
        positions is copied exactly; a smaller cache drops the rest (the caller keeps every live
        row's positions inside it)."""
        out = SlotCache.__new__(SlotCache)
        out.slots, out.slot_tokens = slots, slot_tokens
        out.windows, out.window, out.mixed = self.windows, self.window, self.mixed
        out.keys, out.values = [], []
        kept_slots = min(slots, self.slots)
        for old_list, new_list in ((self.keys, out.keys), (self.values, out.values)):
            for old, window in zip(old_list, self.windows, strict=True):
                if old is None:
                    new_list.append(None)
                    continue
                # a ring's entry j holds position j while its slot is shorter than the window:
                # the kept entries are the first ones either way
                room = self._room(window, slot_tokens)
                kept = min(room, int(old.shape[2]))
                new = old.new_zeros(slots, old.shape[1], room, old.shape[3])
                new[:kept_slots, :, :kept].copy_(old[:kept_slots, :, :kept])
                new_list.append(new)
        out.part, out.span, out.positions, out.ring = slice(0, 0), 0, None, None
        return out

    @property
    def device(self) -> torch.device:
        return next(t for t in self.keys if t is not None).device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    @property
    def position_bytes(self) -> int:
        """Bytes one position of one slot takes, over every layer's keys and values."""
        return self.nbytes // max(1, self.slots * self.slot_tokens)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.keys + self.values if t is not None]

    # -- what a decoding step does ---------------------------------------------------------

    def prepare(self, part: slice, span: int, positions: torch.Tensor) -> None:
        """The next pass runs the slots `part` (a range), each writing at `positions[b]` (`[rows]`
        int64 on the cache's device) and attending over positions [0, span)."""
        lo, hi = part.start, part.stop
        if not 0 < span <= self.slot_tokens or not 0 <= lo < hi <= self.slots:
            fits = f"{self.slots} slots of {self.slot_tokens}"
            raise ValueError(f"a pass of slots [{lo}, {hi}) over {span} positions does not fit {fits}")
        self.part, self.span, self.positions = part, span, positions
        self.ring = None if self.window is None else positions % self.window

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: Any, **__: Any):
        """transformers' cache interface: store one new position per row, return what to attend."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        assert keys is not None and values is not None and self.positions is not None
        rows, new = key.shape[0], key.shape[2]
        if new != 1 or rows != self.part.stop - self.part.start:
            raise ValueError(f"slots take one position per row of the prepared {self.part}, got {list(key.shape)}")
        sliding = self.windows[layer_idx] is not None
        at = (self.ring if sliding else self.positions).reshape(rows, 1, 1, 1)  # type: ignore[union-attr]
        keys[self.part].scatter_(2, at.expand(key.shape), key.to(keys.dtype))
        values[self.part].scatter_(2, at.expand(value.shape), value.to(values.dtype))
        span = min(self.span, int(keys.shape[2]))  # a ring: all of it once the slot passed its window
        return keys[self.part, :, :span], values[self.part, :, :span]

    def attention_mask(
        self, positions: torch.Tensor, span: int, dtype: torch.dtype, full: bool = False
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The step's mask for rows at `positions` over [0, span): each row its own positions up to
        its new one. A sliding layer attends over its ring's first min(span, window) entries: entry
        j holds the latest position p = j (mod window) at or before the row's own, so the last
        `window` positions once the row reached its window, and before that only entries j <= its
        position are its own (a ring's mask is a causal one over entries). A model whose layers all
        slide takes that one mask; one with both, a mask per kind, as its `layer_types` names them.
        None, with `full` (every row sees all `span` positions) and no sliding layer: the model's
        own mask, the attention `generate` runs for an unpadded batch, bit for bit."""
        if self.window is None:
            return None if full else causal_mask(positions, span, dtype)
        local = causal_mask(positions, min(span, self.window, self.slot_tokens), dtype)
        if not self.mixed:
            return local
        return {"full_attention": causal_mask(positions, span, dtype), "sliding_attention": local}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span - 1  # before this pass's position

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """transformers' mask helpers ask (when the runner passes no mask: every row sees its whole
        span): the query is the span's last position."""
        return self.span - 1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.span, 0

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
            if self.windows[index] is None:
                keys[slot, :, :length].copy_(layer.keys[row, :, first : first + length])
                values[slot, :, :length].copy_(layer.values[row, :, first : first + length])
                continue
            # a sliding layer kept the pass's last columns only (transformers keeps window - 1): the
            # row's last positions, [lo, length), each into its ring entry (position % window)
            kept = int(layer.keys.shape[2])
            lo = max(0, length - kept)
            entries = torch.arange(lo, length, device=keys.device) % int(self.windows[index])  # type: ignore[arg-type]
            keys[slot].index_copy_(1, entries, layer.keys[row, :, kept - (length - lo) : kept])
            values[slot].index_copy_(1, entries, layer.values[row, :, kept - (length - lo) : kept])


def position_bytes(prefilled: DynamicCache) -> int:
    """Bytes one position of one slot would take in slots shaped as `prefilled`'s layers."""
    shapes, dtype = _layer_shapes(prefilled)
    item = torch.empty((), dtype=dtype).element_size()
    return sum((kh * kd + vh * vd) * item for (kh, kd), (vh, vd), _ in filter(None, shapes))


def _layer_shapes(
    prefilled: DynamicCache,
) -> tuple[list[tuple[tuple[int, int], tuple[int, int], torch.device] | None], torch.dtype]:
    """Per layer of a filled cache: (key heads, key size), (value heads, value size), device (None:
    a layer that keeps no cache); and their dtype."""
    shapes: list[tuple[tuple[int, int], tuple[int, int], torch.device] | None] = []
    dtype = None
    layer: Any
    for layer in prefilled.layers:
        if not getattr(layer, "is_initialized", False):
            shapes.append(None)
            continue
        keys, values = layer.keys.shape, layer.values.shape
        shapes.append(((int(keys[1]), int(keys[3])), (int(values[1]), int(values[3])), layer.keys.device))
        dtype = layer.keys.dtype
    if dtype is None:
        raise ValueError("the model's forward pass filled no cache layer")
    return shapes, dtype


def causal_mask(positions: torch.Tensor, span: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The additive mask `[B, 1, 1, span]` of a decoding step: row b sees positions [0, positions[b]]
    (its own tokens, the new one included) and nothing after; with a `window` (a local attention
    layer's), only the last `window` of them, as transformers' sliding-window mask has it."""
    rows = positions.shape[0]
    columns = torch.arange(span, device=positions.device).view(1, span)
    at = positions.reshape(rows, 1)
    blocked = columns > at
    if window is not None:
        blocked = blocked | (columns <= at - window)
    return (blocked.to(dtype) * torch.finfo(dtype).min).view(rows, 1, 1, span)

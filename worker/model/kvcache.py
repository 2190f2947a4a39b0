"""Row operations on a transformers `DynamicCache` for a batch whose sequences come and go.

The rows of a batch share one timeline of L positions: a sequence that joined later, or with a
shorter prompt, is padded on the left (keys and values of zeros, masked out by the attention
mask), which is the state Hugging Face's own left-padded batches are in. Only the two layer
kinds `DynamicCache` builds for decoder models are handled: `DynamicLayer` (keys for every
position) and `DynamicSlidingWindowLayer` (keys for the last `sliding_window - 1` positions and
a `cumulative_length` that counts the whole timeline). Any other cache (static, quantized, linear
attention states) is refused by `check_supported` and the model runs one sequence at a time.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

SUPPORTED = (DynamicLayer, DynamicSlidingWindowLayer)


def new_cache(config: object) -> DynamicCache:
    """An empty cache as `generate` makes one (its layer kinds follow the text config)."""
    text = config.get_text_config(decoder=True)  # type: ignore[attr-defined]  # a PretrainedConfig
    return DynamicCache(config=text)


def _layers(cache: DynamicCache) -> list[Any]:
    return list(cache.layers)


def check_supported(cache: DynamicCache) -> str | None:
    """Why this cache's rows cannot be moved between batches, or None when they can."""
    if type(cache) is not DynamicCache:
        return f"{type(cache).__name__} is not a DynamicCache"
    kinds = {type(layer) for layer in cache.layers}
    if not kinds <= set(SUPPORTED):
        return "cache layers " + ", ".join(sorted(k.__name__ for k in kinds - set(SUPPORTED)))
    return None


def _set(layer: Any, keys: torch.Tensor, values: torch.Tensor, timeline: int) -> None:
    layer.keys, layer.values = keys, values
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = timeline


def _stored(layer: Any, timeline: int) -> int:
    """Positions a layer keeps for a timeline of `timeline` positions."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return min(timeline, layer.sliding_window - 1)
    return timeline


def _pad_left(tensor: torch.Tensor, to: int) -> torch.Tensor:
    missing = to - tensor.shape[-2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([pad, tensor], dim=-2)


def concat(caches: list[DynamicCache], timelines: list[int]) -> tuple[DynamicCache, int]:
    """One cache holding the rows of `caches` in order, each left-padded to the longest timeline;
    returns it with that timeline's length. The first cache object is reused.

    All or nothing: the layers grow one at a time (so the extra memory is one layer's, not the
    whole cache's), and if any layer fails (out of memory part-way) the layers already grown go
    back to views of their old rows, which needs no memory, and the error is raised with the
    first cache exactly as it was."""
    timeline = max(timelines)
    out = caches[0]
    grown: list[tuple[Any, tuple]] = []  # (layer, what to put back)
    try:
        for index, layer in enumerate(_layers(out)):
            parts = [_layers(c)[index] for c in caches]
            if not all(p.is_initialized for p in parts):  # a layer that never ran (KV sharing): nothing to move
                continue
            width = _stored(layer, timeline)
            keys = torch.cat([_pad_left(p.keys, width) for p in parts], dim=0)
            values = torch.cat([_pad_left(p.values, width) for p in parts], dim=0)
            old = (layer.keys.shape, getattr(layer, "cumulative_length", None))
            _set(layer, keys, values, timeline)
            grown.append((layer, old))
    except BaseException:
        for layer, (shape, cumulative) in grown:
            rows, stored = shape[0], shape[-2]
            layer.keys = layer.keys[:rows, ..., layer.keys.shape[-2] - stored :, :]
            layer.values = layer.values[:rows, ..., layer.values.shape[-2] - stored :, :]
            if cumulative is not None:
                layer.cumulative_length = cumulative
        raise
    return out, timeline


def select(cache: DynamicCache, rows: torch.Tensor | list[int], timeline: int) -> DynamicCache:
    """A new cache with only `rows` (batch indices) of `cache`; `cache` is left as it was."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    index = torch.as_tensor(rows, dtype=torch.long)
    for layer in _layers(out):
        if layer.is_initialized:
            _set(layer, layer.keys[index.to(layer.keys.device)], layer.values[index.to(layer.values.device)], timeline)
    return out


def crop_left(cache: DynamicCache, drop: int, timeline: int) -> int:
    """Forget the first `drop` positions of the timeline (padding every row has); returns the new
    timeline length."""
    if drop <= 0:
        return timeline
    kept = timeline - drop
    for layer in _layers(cache):
        if layer.is_initialized:
            width = min(layer.keys.shape[-2], _stored(layer, kept))
            _set(
                layer,
                layer.keys[..., layer.keys.shape[-2] - width :, :],
                layer.values[..., layer.values.shape[-2] - width :, :],
                kept,
            )
    return kept


def snapshot(cache: DynamicCache) -> list[tuple]:
    """What `restore` needs to undo a forward pass that failed half-way (references, no copies:
    a layer's update makes new tensors and never writes into the old ones)."""
    return [
        (
            layer.is_initialized,
            getattr(layer, "keys", None),
            getattr(layer, "values", None),
            getattr(layer, "cumulative_length", None),
        )
        for layer in _layers(cache)
    ]


def restore(cache: DynamicCache, saved: list[tuple]) -> None:
    for layer, (initialized, keys, values, cumulative) in zip(_layers(cache), saved, strict=True):
        layer.is_initialized, layer.keys, layer.values = initialized, keys, values
        if cumulative is not None:
            layer.cumulative_length = cumulative

"""The per-sequence state of the persistent batch for recurrent and hybrid models: one slot per
running sequence, as vLLM v1 keeps it.

State-space, convolution and linear-attention layers (Mamba, Mamba-2, and beside attention in
Jamba, LFM2, GraniteMoeHybrid, Qwen3-Next) keep no keys and values that grow with the text: each
sequence has a fixed-size state per layer (transformers' `LinearAttentionLayer`: a convolution
window `conv_states[i]` and a recurrent state `recurrent_states[i]`, for each of the layer's
`number_of_states`). Here each such tensor is allocated once as `[slots, ...]`; the attention
layers of a hybrid keep keys and values `[slots, heads, slot_tokens, head_dim]` as
worker/model/slots.py does (position i of a slot is token i of its sequence). A sequence owns one slot
from its join to its end:

- joining (`take`, `write`): its prompt ran alone through the model's own cache (as `generate`
  runs it); that cache's row 0 is copied into the slot (a layer's state; an attention layer's
  positions [0, P));
- a decoding step (`batch` then `keep`): the running rows' states are gathered from their slots
  into a cache of the model's own class (`kvcache.new_cache`, the layers' flags set as after a
  prefill, so they take their one-token decode path), and each attention layer is a
  `_SlotAttention` that writes the row's new key and value at the row's own position of its slot
  and returns the row's first `span` positions (the pass's 4-D mask, worker/model/slots.py
  `causal_mask`, hides what lies past each row's position). After the pass, the states it left
  go back into the same slots (`keep`). A pass that raises keeps no state (an attention write
  at the row's own position is rewritten by the retry: nothing reads past it);
- leaving (`release`): the slot is free for the next join. Nothing is moved or compacted.

The gathered state is a copy (the rows of a step are the running batch's, the slots are not
contiguous): one state per row per step, far less than the layer's own work.

A local (sliding-window) attention layer (`DynamicSlidingWindowLayer`, RecurrentGemma's) keeps
its slot's positions unwrapped, as a full one does: its prefill's last `window - 1` positions are
written at their own positions, and the step's mask hides, for each row, what
lies past its position and what lies a window or more behind it (worker/model/slots.py
`causal_mask` with the window), as the model's own sliding-window mask does.

State a model keeps on its own modules rather than in its cache (RecurrentGemma's recurrent
blocks: their convolution window `conv1d_state` and the RG-LRU's `recurrent_states`,
`MODULE_STATES`) is held by slot too: snapshotted right after a sequence's prefill, set on the
modules as the running rows' states before each step, and read back after it.

Which models fit (`unsupported`): every cache layer a plain `LinearAttentionLayer`, a plain
full-attention `DynamicLayer` or a `DynamicSlidingWindowLayer`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from worker.model import kvcache

ATTENTION = (DynamicLayer, DynamicSlidingWindowLayer)  # the attention cache layers slots hold
# State kept on a model's modules, not in its cache: module class name -> its tensors' attribute paths.
MODULE_STATES = {"RecurrentGemmaRecurrentBlock": ("conv1d_state", "rg_lru.recurrent_states")}


def unsupported(config: object) -> str | None:
    """Why this model's per-sequence state cannot live in state slots (None: it can)."""
    cache = kvcache.new_cache(config)
    if type(cache) is not DynamicCache:
        return f"its cache is a {type(cache).__name__}"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) not in (LinearAttentionLayer, *ATTENTION)}
    if kinds:
        held = "state-space, full and sliding-window attention layers only"
        return "its cache has " + ", ".join(sorted(kinds)) + f" layers (state slots hold {held})"
    return None


class ModuleStates:
    """The state `model` keeps on its modules (`MODULE_STATES`): each (module, attribute) pair in
    module order. Empty for a model that keeps all its state in its cache (or no model)."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.owners: list[tuple[Any, str]] = []
        for module in model.modules() if model is not None else []:
            for path in MODULE_STATES.get(type(module).__name__, ()):
                *parents, name = path.split(".")
                owner = module
                for parent in parents:
                    owner = getattr(owner, parent)
                self.owners.append((owner, name))

    def snapshot(self) -> list[torch.Tensor]:
        """Row 0 of each state as it stands (after a prefill of one sequence), copied."""
        return [getattr(owner, name)[:1].clone() for owner, name in self.owners]

    def set(self, tensors: list[torch.Tensor]) -> None:
        for (owner, name), tensor in zip(self.owners, tensors, strict=True):
            setattr(owner, name, tensor)

    def current(self) -> list[torch.Tensor]:
        return [getattr(owner, name) for owner, name in self.owners]


class _LayerSlots:
    """One state-space layer's states by slot: `conv[i]`, `recurrent[i]` `[slots, ...]` (absent: the
    layer keeps no such state, e.g. a convolution-only layer has no recurrent state)."""

    def __init__(self, layer: LinearAttentionLayer, slots: int) -> None:
        self.states = layer.number_of_states
        self.kernel = dict(layer.conv_kernel_size)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for i in range(self.states):
            conv, recurrent = layer.conv_states[i], layer.recurrent_states[i]
            if layer.is_conv_states_initialized[i] and conv is not None:
                self.conv[i] = conv.new_zeros(slots, *conv.shape[1:])
            if layer.is_recurrent_states_initialized[i] and recurrent is not None:
                self.recurrent[i] = recurrent.new_zeros(slots, *recurrent.shape[1:])

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.recurrent.values()]

    def write(self, slot: int, layer: Any) -> None:
        for i, tensor in self.conv.items():
            tensor[slot].copy_(layer.conv_states[i][0])
        for i, tensor in self.recurrent.items():
            tensor[slot].copy_(layer.recurrent_states[i][0])

    def resized(self, slots: int, tokens: int) -> None:
        """More slots (all or nothing: the new tensors are made before any is swapped in)."""
        conv = {i: _grown(t, slots) for i, t in self.conv.items()}
        recurrent = {i: _grown(t, slots) for i, t in self.recurrent.items()}
        self.conv, self.recurrent = conv, recurrent

    def gathered(self, layer: Any, index: torch.Tensor) -> None:
        """`layer` (a fresh `LinearAttentionLayer`) holding the states of the slots `index`, as
        after a prefill."""
        for i, tensor in self.conv.items():
            layer.conv_states[i] = tensor.index_select(0, index.to(tensor.device))
            layer.is_conv_states_initialized[i] = True
            layer.conv_kernel_size[i] = self.kernel[i]
            layer.dtype, layer.device = tensor.dtype, tensor.device
        for i, tensor in self.recurrent.items():
            layer.recurrent_states[i] = tensor.index_select(0, index.to(tensor.device))
            layer.is_recurrent_states_initialized[i] = True
        for i in range(self.states):
            layer.has_previous_state[i] = True

    def keep(self, layer: Any, index: torch.Tensor) -> None:
        for i, tensor in self.conv.items():
            tensor.index_copy_(0, index.to(tensor.device), layer.conv_states[i])
        for i, tensor in self.recurrent.items():
            tensor.index_copy_(0, index.to(tensor.device), layer.recurrent_states[i])


class _AttentionSlots:
    """One attention layer's keys and values by slot `[slots, heads, tokens, head_dim]`, position i
    of a slot token i of its sequence; `window`: a sliding-window layer's window (None: full)."""

    def __init__(self, layer: DynamicLayer | DynamicSlidingWindowLayer, slots: int, tokens: int) -> None:
        keys, values = layer.keys, layer.values
        assert keys is not None and values is not None
        self.window: int | None = layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
        self.keys = keys.new_zeros(slots, keys.shape[1], tokens, keys.shape[3])
        self.values = values.new_zeros(slots, values.shape[1], tokens, values.shape[3])

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def write(self, slot: int, layer: Any) -> None:
        """A prefill's positions at their own positions of the slot (a sliding-window layer keeps
        only its text's last ones: those older are never seen again)."""
        length = layer.keys.shape[2]
        first = layer.cumulative_length - length if self.window is not None else 0
        self.keys[slot, :, first : first + length].copy_(layer.keys[0])
        self.values[slot, :, first : first + length].copy_(layer.values[0])

    def resized(self, slots: int, tokens: int) -> None:
        keys, values = _grown(self.keys, slots, tokens), _grown(self.values, slots, tokens)
        self.keys, self.values = keys, values


class _SlotAttention:
    """A full-attention layer of one decoding pass, as transformers' cache calls it: `update` writes
    each row's new key and value at the row's position of its slot and returns every row's first
    `span` positions (a gathered copy; the mask hides each row's positions past its own)."""

    is_sliding = False
    is_compileable = False
    is_initialized = True

    def __init__(self, held: _AttentionSlots, index: torch.Tensor, positions: torch.Tensor, span: int) -> None:
        self.held, self.span = held, span
        self.index, self.positions = index.to(held.keys.device), positions.to(held.keys.device)

    def update(self, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if key.shape[2] != 1 or key.shape[0] != self.index.shape[0]:
            raise ValueError(f"state slots take one position per running row, got keys {list(key.shape)}")
        keys, values = self.held.keys, self.held.values
        keys[self.index, :, self.positions] = key[:, :, 0].to(keys.dtype)
        values[self.index, :, self.positions] = value[:, :, 0].to(values.dtype)
        return keys[self.index, :, : self.span], values[self.index, :, : self.span]

    def get_seq_length(self) -> int:
        return self.span - 1  # before this pass's position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None: ...


class StateSlots:
    """Every layer's per-sequence state, in `slots` slots (an attention layer's of `tokens`
    positions each). Built from the first prefilled cache (its layers' shapes, dtypes and devices);
    grows when more sequences run at once or a longer one joins (`ensure`: new tensors, every
    slot's state copied)."""

    def __init__(
        self,
        config: object,
        prefilled: DynamicCache,
        slots: int,
        tokens: int,
        modules: ModuleStates | None = None,
        snapshot: list[torch.Tensor] | None = None,
    ) -> None:
        """`modules` and a first `snapshot` of theirs: the state the model keeps on its modules."""
        self.config = config
        self.slots, self.tokens = slots, tokens
        self.layers: list[_LayerSlots | _AttentionSlots] = []
        for layer in prefilled.layers:
            if type(layer) is LinearAttentionLayer:
                self.layers.append(_LayerSlots(layer, slots))
            elif isinstance(layer, ATTENTION) and type(layer) in ATTENTION:
                self.layers.append(_AttentionSlots(layer, slots, tokens))
            else:
                raise ValueError(f"state slots hold state-space and attention layers, not {type(layer).__name__}")
        self.modules = modules or ModuleStates()
        self.held = [t.new_zeros(slots, *t.shape[1:]) for t in snapshot or []]  # the modules' states by slot
        self.free: list[int] = list(range(slots))

    @property
    def attends(self) -> bool:
        """Whether any layer is an attention layer (a pass then needs each row's mask)."""
        return any(isinstance(held, _AttentionSlots) for held in self.layers)

    @property
    def window(self) -> int | None:
        """The sliding window of the model's local attention layers (None: none is local)."""
        windows = {held.window for held in self.layers if isinstance(held, _AttentionSlots)} - {None}
        if len(windows) > 1:
            raise ValueError(f"local attention layers of different windows: {sorted(windows)}")  # type: ignore[type-var]
        return next(iter(windows), None)

    @property
    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in self.held)
        return held + sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    # -- joining and leaving ---------------------------------------------------------------

    def take(self, tokens: int) -> int:
        """A free slot (the lowest) of at least `tokens` positions: more slots, or longer ones,
        when needed."""
        self.ensure(self.slots * 2 if not self.free else self.slots, max(self.tokens, tokens))
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        """`slot` is free again; its tensors are left as they are (the next `write` overwrites them)."""
        if slot in self.free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not taken")
        self.free.append(slot)
        self.free.sort()

    def release_all(self) -> None:
        self.free = list(range(self.slots))

    def write(self, slot: int, prefilled: DynamicCache, snapshot: list[torch.Tensor] | None = None) -> None:
        """Row 0 of a prefill's cache (a batch of one) into `slot`, with the modules' `snapshot`
        taken right after that prefill."""
        for layer, held in zip(prefilled.layers, self.layers, strict=True):
            held.write(slot, layer)
        for tensor, state in zip(self.held, snapshot or [], strict=True):
            tensor[slot].copy_(state[0])

    def ensure(self, slots: int, tokens: int) -> None:
        """At least `slots` slots of `tokens` positions: new tensors with every slot's state copied;
        the new slots are free. All or nothing: every new tensor is made before any is swapped in."""
        slots, tokens = max(slots, self.slots), max(tokens, self.tokens)
        if (slots, tokens) == (self.slots, self.tokens):
            return
        grown = []
        for held in self.layers:
            copy = object.__new__(type(held))
            copy.__dict__.update(held.__dict__)
            copy.resized(slots, tokens)
            grown.append(copy)
        modules = [_grown(t, slots) for t in self.held]
        self.layers, self.held = grown, modules
        self.free = self.free + list(range(self.slots, slots))
        self.slots, self.tokens = slots, tokens

    # -- a decoding step -------------------------------------------------------------------

    def batch(self, slots: list[int], positions: torch.Tensor, span: int) -> DynamicCache:
        """A cache of the model's own class for a pass over the sequences in `slots` (that order),
        each feeding the token at `positions[b]` (`[rows]` int64, all below `span`)."""
        cache = kvcache.new_cache(self.config)
        index = torch.tensor(slots, dtype=torch.long, device=positions.device)
        for at, held in enumerate(self.layers):
            if isinstance(held, _LayerSlots):
                held.gathered(cache.layers[at], index)
            else:
                cache.layers[at] = _SlotAttention(held, index, positions, span)  # type: ignore[call-overload]
        self.modules.set([tensor.index_select(0, index.to(tensor.device)) for tensor in self.held])
        return cache

    def keep(self, slots: list[int], cache: DynamicCache) -> None:
        """What a pass left in `cache` (from `batch(slots, ...)`) back into those slots (an attention
        layer wrote its rows during the pass)."""
        index = torch.tensor(slots, dtype=torch.long)
        for layer, held in zip(cache.layers, self.layers, strict=True):
            if isinstance(held, _LayerSlots):
                held.keep(layer, index)
        for tensor, state in zip(self.held, self.modules.current(), strict=True):
            tensor.index_copy_(0, index.to(tensor.device), state)


def _grown(tensor: torch.Tensor, slots: int, tokens: int | None = None) -> torch.Tensor:
    """`tensor` `[slots', ...]` with `slots` rows (and `tokens` positions on dim 2), zeros beyond."""
    shape = list(tensor.shape)
    shape[0] = slots
    if tokens is not None:
        shape[2] = tokens
    new = tensor.new_zeros(shape)
    if tokens is None:
        new[: tensor.shape[0]].copy_(tensor)
    else:
        new[: tensor.shape[0], :, : tensor.shape[2]].copy_(tensor)
    return new

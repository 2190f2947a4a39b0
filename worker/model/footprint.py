"""What one sequence costs in memory beyond the weights, read from the model's configuration.

Published with the model description so the API can bound a job's worker memory without a
tokenizer or a model (shared/capture_spec.working_bytes). Upper bounds by design:

- KV cache: keys and values of every layer for every token (prompt and generated).
- Activations of the prefill, one layer at a time (the layers run in turn and free what they no
  longer need): hidden-sized tensors (residual, norms, q/k/v, attention output, projections) and
  MLP-sized ones (gate, up, their product, the activation), with room for a few copies of each.
- Attention scores, only where the attention implementation materialises `[heads, P, P]`
  (`eager`); PyTorch's SDPA and flash kernels work in tiles.

Measured against a real worker's peak RSS in tests/e2e/test_memory.py.
"""

from __future__ import annotations

import torch

HIDDEN_COPIES = 16  # hidden-sized tensors alive at once in one layer's forward, with room to spare
MLP_COPIES = 8  # intermediate-sized ones


def _get(config: object, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def footprint(config: object, dtype: torch.dtype) -> dict[str, int | None]:
    """`kv_bytes_per_token`, `activation_bytes_per_token`, `attention_bytes_per_token_pair`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    item = torch.empty((), dtype=dtype).element_size()
    layers = _get(text, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _get(text, "hidden_size", "n_embd", "d_model")
    heads = _get(text, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        return {"kv_bytes_per_token": None, "activation_bytes_per_token": None, "attention_bytes_per_token_pair": 0}
    kv_heads = _get(text, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _get(text, "head_dim") or hidden // heads
    intermediate = _get(text, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    eager = getattr(text, "_attn_implementation", None) == "eager"
    return {
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * item,
        "activation_bytes_per_token": (HIDDEN_COPIES * max(hidden, heads * head_dim) + MLP_COPIES * intermediate)
        * item,
        "attention_bytes_per_token_pair": 2 * heads * item if eager else 0,
    }

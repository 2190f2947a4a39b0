"""The tiny configs of the architecture matrix (tests/support/architectures.py): the sizes every
architecture shares (2 layers, hidden 64, 4 heads, 2 key/value heads, context 256, windows of 8),
what a config needs from the tokenizer (`Tokens`), and one builder per architecture: (transformers'
config class, the tokenizer's ids) -> its config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import transformers
from transformers import PreTrainedConfig

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
CONTEXT = 256
SLIDING_WINDOW = 8

WEIGHT_SCALE = 0.3  # standard deviation of matrices and embeddings
BIAS_SCALE = 0.1
GEMMA_EMBEDDING_STD = WEIGHT_SCALE / 32  # see Arch.embedding_std
NORM_SCALE = 0.1  # noise around a norm's identity value (1, or 0 for Gemma's `x * (1 + weight)`)


@dataclass(frozen=True)
class Tokens:
    """What a config needs from the tokenizer."""

    vocab_size: int
    bos: int
    eos: int
    pad: int

    def ids(self) -> dict[str, int]:
        return {
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos,
            "eos_token_id": self.eos,
            "pad_token_id": self.pad,
        }


ConfigClass = Callable[..., PreTrainedConfig]  # a config class of transformers, called with its fields
ConfigMaker = Callable[[ConfigClass, Tokens], PreTrainedConfig]


def _llama_like(cls: ConfigClass, tokens: Tokens, **extra: Any) -> PreTrainedConfig:
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        **tokens.ids(),
        **extra,
    )


def gpt2_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(
        n_embd=HIDDEN,
        n_inner=INTERMEDIATE,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=CONTEXT,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **tokens.ids(),
    )


def gpt_neox_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Parallel residual (the default, as Pythia), rotary on a quarter of each head.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=CONTEXT,
        **tokens.ids(),
    )


def llama_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _llama_like(cls, tokens)


def mistral_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _llama_like(cls, tokens, sliding_window=SLIDING_WINDOW)


def qwen2_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Qwen2Config has no head_dim field: hidden / heads.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        **tokens.ids(),
    )


def qwen3_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _llama_like(cls, tokens)  # q_norm / k_norm per head


def _gemma_text(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # One sliding layer and one full layer; softcapping left at the arch's defaults (Gemma 2: attention 50,
    # logits 30). Attention scores scaled by 4 ** -0.5 rather than head_dim ** -0.5: with Gemma 3's q_norm and
    # k_norm, random weights otherwise give near-uniform attention and greedy decoding runs into repeats.
    return _llama_like(
        cls,
        tokens,
        query_pre_attn_scalar=4,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )


def gemma2_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _gemma_text(cls, tokens)


def gemma3_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _gemma_text(cls, tokens)


# SmolLM2's code-dataset markers: added tokens that plain text and the chat template never produce
# (unless a text spells them out), so the image placeholders never turn up in a prompt.
GEMMA3_BOI = 14  # <jupyter_output>
GEMMA3_EOI = 15  # <jupyter_script>
GEMMA3_IMAGE = 16  # <empty_output>


def gemma3_mm_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # The composite layout of Gemma 3 4B and up: vocab_size, hidden_size, ... live in text_config.
    # The vision tower: one 28x28 image -> 2x2 patches of 14 -> 4 soft tokens (pooling kernel 1).
    text = _gemma_text(transformers.Gemma3TextConfig, tokens)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_use_head=False,
    )
    return cls(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=GEMMA3_BOI,
        eoi_token_index=GEMMA3_EOI,
        image_token_index=GEMMA3_IMAGE,
    )


def phi3_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Fused qkv_proj and gate_up_proj; its pad id defaults to 32000, replaced by the tokenizer's.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        original_max_position_embeddings=CONTEXT,
        **tokens.ids(),
    )


def opt_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Pre-norm (do_layer_norm_before, as every OPT but 350m); no grouped attention.
    return cls(
        hidden_size=HIDDEN,
        ffn_dim=INTERMEDIATE,
        word_embed_proj_dim=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=CONTEXT,
        dropout=0.0,
        **tokens.ids(),
    )


def falcon_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Falcon-7B's layout: attention and MLP in parallel off one input_layernorm, multi-query (1 KV head).
    return cls(
        hidden_size=HIDDEN,
        ffn_hidden_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=CONTEXT,
        parallel_attn=True,
        new_decoder_architecture=False,
        multi_query=True,
        **tokens.ids(),
    )


def falcon_new_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Falcon-40B/180B's layout: grouped key/value heads, separate ln_attn and ln_mlp.
    return cls(
        hidden_size=HIDDEN,
        ffn_hidden_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        new_decoder_architecture=True,
        **tokens.ids(),
    )


# Models whose cache is not a plain DynamicCache of attention layers: state-space, recurrent, linear-attention
# and convolution layers (alone or beside attention layers). The worker batches them in state slots, or
# runs them one job at a time at ACTQ_MAX_BATCH=1 (see STATE_SLOTS). Two layers each: the hybrids have one
# layer of each kind.


def mamba_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Every block a selective state-space mixer: no attention, no MLP. Inner width expand * hidden = 128.
    return cls(hidden_size=HIDDEN, num_hidden_layers=LAYERS, state_size=16, expand=2, conv_kernel=4, **tokens.ids())


def mamba2_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # 8 heads of 16 = expand * hidden; chunks of 16 so that a prompt spans several of the scan's chunks.
    return cls(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_heads=8,
        head_dim=16,
        n_groups=1,
        state_size=16,
        expand=2,
        conv_kernel=4,
        chunk_size=16,
        **tokens.ids(),
    )


def jamba_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Layer 0: Mamba mixer and a dense MLP; layer 1: attention and a sparse MoE block (4 experts, top 2).
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_dt_rank=4,
        **tokens.ids(),
    )


def recurrent_gemma_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Layer 0: the RG-LRU recurrent block (its state lives in the module); layer 1: local attention, window 8.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        lru_width=HIDDEN,
        attention_window_size=SLIDING_WINDOW,
        block_types=["recurrent", "attention"],
        **tokens.ids(),
    )


def granitemoehybrid_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Layer 0: Mamba-2 mixer; layer 1: attention; both with 4 experts (top 2) beside a shared MLP.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        layer_types=["mamba", "attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=INTERMEDIATE,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
        **tokens.ids(),
    )


def qwen3_next_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Layer 0: gated delta-net linear attention; layer 1: gated full attention; both sparse MoE (4 experts, top 2).
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **tokens.ids(),
    )


def lfm2_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Layer 0: gated short convolution (a 3-position state); layer 1: attention. MLP width as given.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        layer_types=["conv", "full_attention"],
        block_auto_adjust_ff_dim=False,
        **tokens.ids(),
    )


# Mixture-of-experts models: 4 experts, 2 per token. Not in ARCHS (their cache is a plain DynamicCache and
# they batch as the others do); the preset tests build them.


def _moe_base(tokens: Tokens) -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": CONTEXT,
        **tokens.ids(),
    }


def mixtral_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2, **_moe_base(tokens))


def qwen2_moe_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Its experts block holds a gated shared expert too.
    return cls(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **_moe_base(tokens),
    )


def qwen3_moe_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_moe_base(tokens))


def olmoe_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(num_experts=4, num_experts_per_tok=2, **_moe_base(tokens))


def granitemoe_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # The experts block is `block_sparse_moe`, not `mlp`.
    return cls(num_local_experts=4, num_experts_per_tok=2, **_moe_base(tokens))


def deepseek_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Multi-head latent attention (as many key/value heads as heads); layer 0 a dense MLP, layer 1 experts
    # with a shared expert; plain rotary embeddings (the default YaRN scaling assumes a long context).
    return cls(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **{**_moe_base(tokens), "num_key_value_heads": HEADS},
    )


def gpt_oss_config(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(
        head_dim=HEAD_DIM,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        **_moe_base(tokens),
    )

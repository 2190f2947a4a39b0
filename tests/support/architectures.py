"""Tiny random-weight causal LMs of many architectures, for the test matrix that compares captured
activations against forward hooks.

Each entry of ARCHS describes one architecture; `build` writes a model folder that a worker loads with
`AutoTokenizer.from_pretrained(folder)` and `AutoModelForCausalLM.from_pretrained(folder)`: SmolLM2's real
tokenizer (vocabulary 49152, with or without its chat template), 2 decoder layers, hidden 64, 4 attention
heads (2 key/value heads where the architecture has grouped attention), intermediate 128, context 256,
sliding windows of 8 tokens where the architecture has them, float32 weights drawn from a generator seeded
per architecture (the same folder contents on every build). Each architecture keeps transformers' default
attention implementation: sdpa, but eager for Gemma 2 (transformers picks it for its attention softcapping).
The architectures in SOLO (state-space, recurrent, linear-attention and convolution layers) have a cache
whose rows cannot move between batches: all of them (STATE_SLOTS) batch with each job's state in a slot
(worker/batch/state_decoding.py); ONE_AT_A_TIME names those the one-job-at-a-time decoder is tested on.
MOE_ARCHS, mixture-of-experts models, are not in ARCHS (the matrix): the preset tests build them.

    from tests.support.architectures import ARCHS, available, build

    @pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.key)
    def test_capture(arch, tmp_path, smol_dir):
        if reason := available(arch):
            pytest.skip(reason)
        folder = build(arch, tmp_path / arch.key, smol_dir)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel

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


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix.

    key: short name ("gpt2"), also the per-arch seed.
    config_class: the config class's name in transformers (the arch is skipped where it is missing).
    model_class: the class AutoModelForCausalLM gives for the folder.
    layers: module path of the decoder blocks' ModuleList (block i is f"{layers}.{i}").
    make_config: (config class, the tokenizer's ids) -> the tiny config.
    requires: further class names in transformers the arch needs (the vision config of a multimodal one).
    presets: the presets the worker publishes for it (worker/model/presets.py): a block without an attention
        module (a state-space or convolution layer) gives no `attention` preset, a block whose MLP is two
        modules summed (GraniteMoeHybrid's experts beside a shared MLP) no `mlp` preset.
    embedding_std: standard deviation of the token embeddings. Gemma multiplies them by sqrt(hidden) = 8
        and normalizes every sublayer's output before the residual add: at the default scale the token's
        own embedding dominates the residual stream and, through the tied lm_head, greedy decoding repeats
        the last token forever; Gemma's entries use GEMMA_EMBEDDING_STD.
    """

    key: str
    config_class: str
    model_class: str
    layers: str
    make_config: ConfigMaker
    requires: tuple[str, ...] = ()
    embedding_std: float = WEIGHT_SCALE
    presets: tuple[str, ...] = ("residual", "attention", "mlp")

    def block(self, index: int = 0) -> str:
        return f"{self.layers}.{index}"


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


def _gpt2(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _gpt_neox(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Parallel residual (the default, as Pythia), rotary on a quarter of each head.
    return cls(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=CONTEXT,
        **tokens.ids(),
    )


def _llama(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _llama_like(cls, tokens)


def _mistral(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _llama_like(cls, tokens, sliding_window=SLIDING_WINDOW)


def _qwen2(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _qwen3(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _gemma2(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _gemma_text(cls, tokens)


def _gemma3(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return _gemma_text(cls, tokens)


# SmolLM2's code-dataset markers: added tokens that plain text and the chat template never produce
# (unless a text spells them out), so the image placeholders never turn up in a prompt.
GEMMA3_BOI = 14  # <jupyter_output>
GEMMA3_EOI = 15  # <jupyter_script>
GEMMA3_IMAGE = 16  # <empty_output>


def _gemma3_mm(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _phi3(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _opt(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _falcon(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _falcon_new(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _mamba(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Every block a selective state-space mixer: no attention, no MLP. Inner width expand * hidden = 128.
    return cls(hidden_size=HIDDEN, num_hidden_layers=LAYERS, state_size=16, expand=2, conv_kernel=4, **tokens.ids())


def _mamba2(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _jamba(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _recurrent_gemma(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _granitemoehybrid(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _qwen3_next(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _lfm2(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _mixtral(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(head_dim=HEAD_DIM, num_local_experts=4, num_experts_per_tok=2, **_moe_base(tokens))


def _qwen2_moe(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # Its experts block holds a gated shared expert too.
    return cls(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **_moe_base(tokens),
    )


def _qwen3_moe(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_moe_base(tokens))


def _olmoe(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(num_experts=4, num_experts_per_tok=2, **_moe_base(tokens))


def _granitemoe(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    # The experts block is `block_sparse_moe`, not `mlp`.
    return cls(num_local_experts=4, num_experts_per_tok=2, **_moe_base(tokens))


def _deepseek(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
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


def _gpt_oss(cls: ConfigClass, tokens: Tokens) -> PreTrainedConfig:
    return cls(
        head_dim=HEAD_DIM,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        **_moe_base(tokens),
    )


ARCHS: list[Arch] = [
    Arch("gpt2", "GPT2Config", "GPT2LMHeadModel", "transformer.h", _gpt2),
    Arch("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", "gpt_neox.layers", _gpt_neox),
    Arch("llama", "LlamaConfig", "LlamaForCausalLM", "model.layers", _llama),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", "model.layers", _mistral),
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "model.layers", _qwen2),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "model.layers", _qwen3),
    Arch("gemma2", "Gemma2Config", "Gemma2ForCausalLM", "model.layers", _gemma2, embedding_std=GEMMA_EMBEDDING_STD),
    Arch("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", "model.layers", _gemma3, embedding_std=GEMMA_EMBEDDING_STD),
    Arch(
        "gemma3_mm",
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        "model.language_model.layers",
        _gemma3_mm,
        requires=("Gemma3TextConfig", "SiglipVisionConfig"),
        embedding_std=GEMMA_EMBEDDING_STD,
    ),
    Arch("phi3", "Phi3Config", "Phi3ForCausalLM", "model.layers", _phi3),
    Arch("opt", "OPTConfig", "OPTForCausalLM", "model.decoder.layers", _opt),
    Arch("falcon", "FalconConfig", "FalconForCausalLM", "transformer.h", _falcon),
    Arch("falcon_new", "FalconConfig", "FalconForCausalLM", "transformer.h", _falcon_new),
    Arch("mamba", "MambaConfig", "MambaForCausalLM", "backbone.layers", _mamba, presets=("residual",)),
    Arch("mamba2", "Mamba2Config", "Mamba2ForCausalLM", "backbone.layers", _mamba2, presets=("residual",)),
    Arch("jamba", "JambaConfig", "JambaForCausalLM", "model.layers", _jamba, presets=("residual", "mlp")),
    Arch(
        "recurrent_gemma",
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        "model.layers",
        _recurrent_gemma,
        presets=("residual", "mlp"),
    ),
    Arch(
        "granitemoehybrid",
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        "model.layers",
        _granitemoehybrid,
        presets=("residual",),
    ),
    Arch(
        "qwen3_next",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "model.layers",
        _qwen3_next,
        presets=("residual", "mlp"),
    ),
    Arch("lfm2", "Lfm2Config", "Lfm2ForCausalLM", "model.layers", _lfm2, presets=("residual", "mlp")),
]

# Architectures whose cache rows cannot move between batches (kvcache.check_supported refuses them).
SOLO: tuple[str, ...] = ("mamba", "mamba2", "jamba", "recurrent_gemma", "granitemoehybrid", "qwen3_next", "lfm2")
# Those of SOLO that batch, each job's state in a slot (worker/batch/state_decoding.py): all of them (their
# cache layers are recurrent states, full and sliding-window attention; RecurrentGemma's recurrent state
# lives in its modules).
STATE_SLOTS: tuple[str, ...] = SOLO
# The one-job-at-a-time decoder (worker/batch/solo.py: a cache that cannot be batched, or any of SOLO at
# ACTQ_MAX_BATCH=1) is tested on RecurrentGemma made to take it: its state in its modules is the hardest case.
ONE_AT_A_TIME: tuple[str, ...] = ("recurrent_gemma",)

MOE_ARCHS: list[Arch] = [
    Arch("mixtral", "MixtralConfig", "MixtralForCausalLM", "model.layers", _mixtral),
    Arch("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "model.layers", _qwen2_moe),
    Arch("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "model.layers", _qwen3_moe),
    Arch("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "model.layers", _olmoe),
    Arch("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", "model.layers", _granitemoe),
    Arch("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "model.layers", _deepseek),
    Arch("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "model.layers", _deepseek),
    Arch("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "model.layers", _gpt_oss),
]

BY_KEY: dict[str, Arch] = {arch.key: arch for arch in [*ARCHS, *MOE_ARCHS]}


def available(arch: Arch) -> str | None:
    """None when the installed transformers has the architecture, else the reason to skip it."""
    for name in (arch.config_class, arch.model_class, *arch.requires):
        if getattr(transformers, name, None) is None:
            return f"transformers {transformers.__version__} has no {name}"
    return None


def tokens_of(tokenizer: Any) -> Tokens:
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    return Tokens(vocab_size=len(tokenizer), bos=bos, eos=eos, pad=pad)


def _is_norm(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def randomize(model: PreTrainedModel, seed: int, embedding_std: float = WEIGHT_SCALE) -> None:
    """Overwrite every parameter with seeded random values: the token embeddings normal * embedding_std, other
    matrices and embeddings normal * WEIGHT_SCALE, biases normal * BIAS_SCALE, norms' parameters their
    initialized identity value (weight 1 or Gemma's 0, bias 0) plus normal * NORM_SCALE. Tied parameters are
    drawn once."""
    generator = torch.Generator().manual_seed(seed)
    token_embeddings = model.get_input_embeddings().weight
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            norm = _is_norm(module)
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                if param is token_embeddings:
                    param.copy_(noise * embedding_std)
                elif norm:
                    param.add_(noise * NORM_SCALE)
                elif name == "bias" or param.dim() == 1:
                    param.copy_(noise * BIAS_SCALE)
                else:
                    param.copy_(noise * WEIGHT_SCALE)


def build(arch: Arch, target: Path, tokenizer_dir: Path, chat_template: bool = True) -> Path:
    """Write the tiny model of `arch` and the tokenizer of `tokenizer_dir` into `target` (created);
    without `chat_template`, the tokenizer is saved without its chat template (a base model)."""
    if reason := available(arch):
        raise RuntimeError(reason)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokens = tokens_of(tokenizer)
    config = arch.make_config(getattr(transformers, arch.config_class), tokens)
    with torch.random.fork_rng(devices=[]):  # the init draws from the global generator: leave it as it was
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, zlib.crc32(arch.key.encode()), arch.embedding_std)
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id, generation.pad_token_id = tokens.bos, tokens.eos, tokens.pad
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    if not chat_template:
        tokenizer.chat_template = None
        for stale in ("chat_template.jinja", "chat_template.json"):
            (target / stale).unlink(missing_ok=True)
    tokenizer.save_pretrained(target)
    return target

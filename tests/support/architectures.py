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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tests.support.arch_configs import (
    BIAS_SCALE,
    GEMMA_EMBEDDING_STD,
    NORM_SCALE,
    WEIGHT_SCALE,
    ConfigMaker,
    Tokens,
    deepseek_config,
    falcon_config,
    falcon_new_config,
    gemma2_config,
    gemma3_config,
    gemma3_mm_config,
    gpt2_config,
    gpt_neox_config,
    gpt_oss_config,
    granitemoe_config,
    granitemoehybrid_config,
    jamba_config,
    lfm2_config,
    llama_config,
    mamba2_config,
    mamba_config,
    mistral_config,
    mixtral_config,
    olmoe_config,
    opt_config,
    phi3_config,
    qwen2_config,
    qwen2_moe_config,
    qwen3_config,
    qwen3_moe_config,
    qwen3_next_config,
    recurrent_gemma_config,
)


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


ARCHS: list[Arch] = [
    Arch("gpt2", "GPT2Config", "GPT2LMHeadModel", "transformer.h", gpt2_config),
    Arch("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", "gpt_neox.layers", gpt_neox_config),
    Arch("llama", "LlamaConfig", "LlamaForCausalLM", "model.layers", llama_config),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", "model.layers", mistral_config),
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "model.layers", qwen2_config),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "model.layers", qwen3_config),
    Arch(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM", "model.layers", gemma2_config, embedding_std=GEMMA_EMBEDDING_STD
    ),
    Arch(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "model.layers",
        gemma3_config,
        embedding_std=GEMMA_EMBEDDING_STD,
    ),
    Arch(
        "gemma3_mm",
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        "model.language_model.layers",
        gemma3_mm_config,
        requires=("Gemma3TextConfig", "SiglipVisionConfig"),
        embedding_std=GEMMA_EMBEDDING_STD,
    ),
    Arch("phi3", "Phi3Config", "Phi3ForCausalLM", "model.layers", phi3_config),
    Arch("opt", "OPTConfig", "OPTForCausalLM", "model.decoder.layers", opt_config),
    Arch("falcon", "FalconConfig", "FalconForCausalLM", "transformer.h", falcon_config),
    Arch("falcon_new", "FalconConfig", "FalconForCausalLM", "transformer.h", falcon_new_config),
    Arch("mamba", "MambaConfig", "MambaForCausalLM", "backbone.layers", mamba_config, presets=("residual",)),
    Arch("mamba2", "Mamba2Config", "Mamba2ForCausalLM", "backbone.layers", mamba2_config, presets=("residual",)),
    Arch("jamba", "JambaConfig", "JambaForCausalLM", "model.layers", jamba_config, presets=("residual", "mlp")),
    Arch(
        "recurrent_gemma",
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        "model.layers",
        recurrent_gemma_config,
        presets=("residual", "mlp"),
    ),
    Arch(
        "granitemoehybrid",
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        "model.layers",
        granitemoehybrid_config,
        presets=("residual",),
    ),
    Arch(
        "qwen3_next",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "model.layers",
        qwen3_next_config,
        presets=("residual", "mlp"),
    ),
    Arch("lfm2", "Lfm2Config", "Lfm2ForCausalLM", "model.layers", lfm2_config, presets=("residual", "mlp")),
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
    Arch("mixtral", "MixtralConfig", "MixtralForCausalLM", "model.layers", mixtral_config),
    Arch("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "model.layers", qwen2_moe_config),
    Arch("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "model.layers", qwen3_moe_config),
    Arch("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "model.layers", olmoe_config),
    Arch("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", "model.layers", granitemoe_config),
    Arch("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "model.layers", deepseek_config),
    Arch("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "model.layers", deepseek_config),
    Arch("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "model.layers", gpt_oss_config),
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

"""A tiny random-weight Llama for fast tests: 4 layers, hidden 64, SmolLM2's real tokenizer and
chat template (taken from the converted built-in model, no download)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

TINY_CONTEXT = 256


def build(
    target: Path,
    tokenizer_dir: Path,
    *,
    intermediate_size: int = 128,
    num_hidden_layers: int = 4,
    max_position_embeddings: int = TINY_CONTEXT,
    scale: float = 0.5,
    seed: int = 1234,
) -> Path:
    """A random Llama (hidden 64) in `target`, with the tokenizer of `tokenizer_dir`; the tiny model by
    default, other widths, depths and contexts on request (e.g. a long-context, wide-MLP model)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target

"""docs/gpu.md's figures are actq's own: the memory per token that the worker publishes for
Qwen2.5-7B-Instruct and Llama-3.1-8B-Instruct (worker/model/footprint.py on their configurations), their
parameter counts (the models built on the meta device: no weights), and the throughput ceilings
recomputed from the page's own formula."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from worker.model.footprint import footprint

PAGE = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
# The Hub's config.json of each (the sizes that matter here), and the page's name for it.
MODELS = {
    "Qwen2.5-7B": Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "Llama-3.1-8B": LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
}
BANDWIDTH = {"RTX 4090": 1.008e12, "A100 80 GB": 2.039e12, "H100 80 GB": 3.35e12}  # bytes/s, the vendors' figures
ROW_TOKENS = 1000


def parameters(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def table_row(text: str, first_cell: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_the_memory_figures_are_what_the_worker_publishes():
    text = PAGE.read_text()
    published = {name: footprint(config, torch.bfloat16) for name, config in MODELS.items()}
    weights = {name: parameters(config) * 2 for name, config in MODELS.items()}
    kv = table_row(text, "KV cache, per token (GPU)")
    passes = table_row(text, "a prompt's pass, per token fed (GPU)")
    stored = table_row(text, "the weights (GPU)")
    sizes = table_row(text, "parameters")
    for column, name in enumerate(MODELS):
        assert f"{published[name]['kv_bytes_per_token']:,} bytes" in kv[column + 1], name
        assert f"{published[name]['activation_bytes_per_token']:,} bytes" in passes[column + 1], name
        assert stored[column + 1].startswith(f"{weights[name] / 1e9:.1f} GB ({weights[name] / 2**30:.1f} GiB)"), name
        assert sizes[column] == f"{weights[name] / 2 / 1e9:.2f} B", name
        config = MODELS[name]
        layers = f"{config.num_hidden_layers}, {config.hidden_size:,}, {config.intermediate_size:,}"
        assert table_row(text, "layers, hidden size, MLP size")[column] == layers
        assert table_row(text, "context")[column] == f"{config.max_position_embeddings:,}"


@pytest.mark.parametrize("name", list(MODELS))
def test_the_throughput_ceilings_follow_the_page_s_formula(name):
    """batch × bandwidth / (weights + batch × tokens per row × KV bytes per token)."""
    text = PAGE.read_text()
    weights = parameters(MODELS[name]) * 2
    kv = footprint(MODELS[name], torch.bfloat16)["kv_bytes_per_token"]
    assert kv is not None
    for gpu, bandwidth in BANDWIDTH.items():
        (row,) = [line for line in text.splitlines() if re.match(rf"\| {re.escape(name)}\S*, {gpu}\b", line)]
        cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
        for batch, cell in zip((1, 16, 64), cells, strict=True):
            if cell == "(does not fit)":
                continue
            expected = round(batch * bandwidth / (weights + batch * ROW_TOKENS * kv))
            assert cell == f"{expected:,}", (name, gpu, batch, cell, expected)

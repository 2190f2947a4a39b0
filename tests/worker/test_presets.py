"""Presets resolved from the loaded model (worker/model/presets.py) for mixture-of-experts models and for
models whose blocks are not all attention + MLP: which presets each publishes, each one module
inside its block, and an `mlp` capture of an experts block equal to forward hooks on `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.capture_spec import resolve
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.architectures import BY_KEY, MOE_ARCHS, SOLO, Arch, available, build
from tests.support.reference import hooked_generate

pytestmark = pytest.mark.model  # builds and loads tiny models in this process

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
# Where each experts block lives (a child named `experts` inside it); every other MoE arch uses `mlp`.
EXPERTS_AT = {"granitemoe": "block_sparse_moe"}


def engine_for(arch: Arch, tmp_path: Path, smol_dir: Path):
    """The capture engine of `arch`'s tiny model (skipped where transformers lacks it)."""
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    if reason := available(arch):
        pytest.skip(reason)
    folder = build(arch, tmp_path / arch.key, smol_dir)
    return ServedModel(load(Settings(model=str(folder), model_name="m")))


@pytest.mark.parametrize("key", [a.key for a in MOE_ARCHS] + list(SOLO))
def test_each_architecture_publishes_its_presets_one_module_per_block(key, tmp_path, smol_dir):
    """MoE blocks give `mlp` (their experts block, whatever its name); a block without attention
    (Mamba, a hybrid's state-space or convolution layer) gives no `attention`; GraniteMoeHybrid's
    experts summed with a shared MLP give no `mlp`."""
    arch = BY_KEY[key]
    served = engine_for(arch, tmp_path, smol_dir)
    presets = served.info.presets
    assert set(presets) == set(arch.presets), presets
    blocks = presets["residual"]
    assert blocks == [arch.block(i) for i in range(served.info.num_layers)]
    for name, paths in presets.items():
        if name != "residual":
            assert all(p.startswith(f"{block}.") for p, block in zip(paths, blocks, strict=True)), (name, paths)


@pytest.mark.parametrize("arch", MOE_ARCHS, ids=lambda a: a.key)
def test_the_mlp_preset_of_a_moe_model_is_its_experts_block_and_captures_exactly(arch, tmp_path, smol_dir):
    served = engine_for(arch, tmp_path, smol_dir)
    mlp = served.info.presets["mlp"]
    blocks = served.info.presets["residual"]
    attribute = EXPERTS_AT.get(arch.key, "mlp")
    assert mlp == [f"{block}.{attribute}" for block in blocks]
    holds_experts = [hasattr(served.hf.get_submodule(path), "experts") for path in mlp]
    # DeepSeek's first layer is a dense MLP (first_k_dense_replace): the others hold experts
    assert holds_experts == ([False, True] if arch.key.startswith("deepseek") else [True, True])

    req = JobRequest.model_validate({"model": "m", "messages": MESSAGES, "capture": {"preset": "mlp"}})
    gen = served.run(req, resolve(req.capture, served.info), 6)
    ids, rows, prompt_tokens = hooked_generate(served.hf, served.tokenizer, MESSAGES, 6, mlp)
    assert torch.equal(gen.token_ids, ids)
    assert [c.point.module for c in gen.captured] == mlp
    for captured in gen.captured:
        assert torch.equal(captured.tensor, rows[captured.point.module]), captured.point.name

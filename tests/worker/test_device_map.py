"""ACTQ_DEVICE_MAP: a model placed module by module through accelerate. This machine has no GPU, so
the model tests use a map that offloads two of the four decoder layers to disk: accelerate then
hooks every module (weights loaded at each forward, inputs moved to each module's device), which
is the machinery a multi-GPU map runs on. Captures must stay exact against plain forward hooks on
a plain Hugging Face model, alone and in a batch (tests/gpu repeats this with `auto` on CUDA)."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.capture_spec import resolve
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.reference import hooked_forward, hooked_generate, select
from tests.worker.test_batching import assert_same, job, run_batched

MESSAGES = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April. How many in May?"}]
MODULES = ["model.layers.0", "model.layers.1", "model.layers.1.mlp", "model.layers.3.input_layernorm", "model.norm"]
LAYOUT = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


def write_map(path, placed) -> str:
    path.write_text(json.dumps(placed))
    return str(path)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "is neither one of auto, balanced, balanced_low_0, sequential nor a readable file"),
        ("{not json", "is not JSON"),
        ("[]", "must hold a JSON object of module name -> device"),
        ('{"model.layers.0": true}', 'give a GPU number, "cpu", "cuda:N" or "disk"'),
        ('{"model.layers.0": [0]}', 'give a GPU number, "cpu", "cuda:N" or "disk"'),
    ],
)
def test_a_bad_device_map_is_refused_with_what_to_change(tmp_path, content, says):
    from worker.model.loading import read_device_map

    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="ACTQ_DEVICE_MAP=") as raised:
        read_device_map(str(path))
    assert says in str(raised.value)


def test_a_strategy_or_a_map_file_is_read_as_accelerate_takes_it(tmp_path):
    from worker.model.loading import read_device_map

    assert read_device_map("balanced") == "balanced"
    assert read_device_map(write_map(tmp_path / "map.json", {"model": 0, "lm_head": "cpu"})) == {
        "model": 0,
        "lm_head": "cpu",
    }


def test_a_device_and_a_device_map_together_are_refused():
    with pytest.raises(ValidationError, match="set ACTQ_DEVICE or ACTQ_DEVICE_MAP, not both"):
        Settings(device="cpu", device_map="auto")


@pytest.fixture(scope="module")
def placed(tiny_dir, tmp_path_factory):
    """The engine on the tiny model as the map places it, and a plain HF copy for the reference."""
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    folder = tmp_path_factory.mktemp("device-map")
    settings = Settings(
        model=str(tiny_dir), model_name="m", device_map=write_map(folder / "map.json", LAYOUT), model_cache_dir=folder
    )
    served = ServedModel(load(settings))
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return served, plain, AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.model
def test_the_map_places_each_module_through_accelerate(placed):
    served, _, _ = placed
    assert served.hf.hf_device_map == LAYOUT
    assert served.loaded.device == "cpu"
    offloaded = served.hf.get_submodule("model.layers.1.mlp.up_proj")
    assert hasattr(offloaded, "_hf_hook") and offloaded.weight.device.type == "meta"  # loaded at each forward
    assert served.hf.get_submodule("model.layers.0.mlp.up_proj").weight.device.type == "cpu"
    assert not served.cuda_graphs and "offloads" in (served.graphs_reason or "")  # no graphs: steps run eagerly


@pytest.mark.model
@pytest.mark.parametrize("positions", ["all", "generated"])
def test_a_generation_on_a_placed_model_equals_forward_hooks_on_the_plain_one(placed, positions):
    served, plain, tokenizer = placed
    req = JobRequest.model_validate(
        {"model": "m", "messages": MESSAGES, "capture": {"modules": MODULES, "positions": positions}}
    )
    gen = served.run(req, resolve(req.capture, served.info), 10)
    ids, rows, prompt_tokens = hooked_generate(plain, tokenizer, MESSAGES, 10, MODULES)
    assert torch.equal(gen.token_ids, ids)
    assert sorted(c.point.module for c in gen.captured) == sorted(MODULES)
    for captured in gen.captured:
        expected = select(rows[captured.point.module], positions, prompt_tokens, 10)
        torch.testing.assert_close(captured.tensor, expected, rtol=1e-5, atol=1e-6, msg=captured.point.name)


@pytest.mark.model
def test_jobs_batched_on_a_placed_model_each_get_their_solo_result(placed):
    served, _, _ = placed
    capture = {"modules": MODULES, "positions": "all"}
    jobs = [
        job("What is 2+3?", 8, capture),
        job("Name three colours.", 12, {**capture, "positions": "generated"}),
        job("Count to five.", 6, None),
    ]
    batched, largest = run_batched(served, jobs, join_at=[0, 0, 2])
    assert largest == 3
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        alone = served.run(req, resolve(req.capture, served.info) if req.capture else [], n)
        assert_same(got, alone, f"job {i}")


@pytest.mark.model
def test_a_trace_on_a_placed_model_equals_one_plain_forward_pass(placed):
    served, plain, tokenizer = placed
    text = "Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?"
    req = JobRequest.model_validate(
        {"model": "m", "mode": "trace", "prompt": text, "capture": {"modules": MODULES, "positions": "all"}}
    )
    gen = served.run(req, resolve(req.capture, served.info), 0)
    kept, _ = hooked_forward(plain, tokenizer(text, return_tensors="pt")["input_ids"], MODULES)
    assert sorted(c.point.module for c in gen.captured) == sorted(MODULES)
    for captured in gen.captured:
        torch.testing.assert_close(captured.tensor, kept[captured.point.module], rtol=1e-5, atol=1e-6)

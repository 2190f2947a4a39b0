"""The architecture matrix, in process: a tiny random model of each architecture researchers bring
(tests/support/architectures.py), loaded as a worker loads it (worker.model.loading.load, ServedModel),
every listed module captured and compared with plain forward hooks on the same weights
(tests/support/reference.py, cloning in the hook). Float32 on the CPU: the values must be identical.

Each job here runs alone (`ServedModel.run`, a batch of one: a sliding-window model's is the
compacting decoder's, a recurrent model's the solo decoder's, each `generate` bit for bit). Real
workers serve a representative of the slots and of the state slots, and a base model, through the
API: tests/e2e/test_architectures.py. Each
architecture's figures go into the JUnit XML (`--junitxml`) as properties: modules listed, max abs
difference on outputs and inputs, raw prompt ok.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.capture_spec import CaptureSpecError, resolve
from shared.schemas import JobRequest
from tests.support.architectures import ARCHS, Arch, available, build
from tests.support.reference import hooked_generate, select
from tests.worker.test_batching import load_engine
from worker.batch.generation import Generation

pytestmark = pytest.mark.model  # builds and loads tiny models in this process

MESSAGES = [{"role": "user", "content": "What is 2+3? Think step by step, then answer."}]
PROMPT = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
NEW_TOKENS = 4
# Base checkpoints in the wild (GPT-2, Pythia, OPT, Falcon): built without a chat template.
BASE_MODELS = {"gpt2", "gpt_neox", "opt", "falcon", "falcon_new"}


@dataclass
class Loaded:
    arch: Arch
    served: object  # worker.batch.served.ServedModel
    model: torch.nn.Module
    tokenizer: object


@pytest.fixture(scope="module", params=ARCHS, ids=[a.key for a in ARCHS])
def loaded(request, tmp_path_factory, smol_dir) -> Iterator[Loaded]:
    arch: Arch = request.param
    if reason := available(arch):
        pytest.skip(reason)
    folder = build(arch, tmp_path_factory.mktemp("archs") / arch.key, smol_dir, arch.key not in BASE_MODELS)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    yield Loaded(arch, load_engine(folder), model, AutoTokenizer.from_pretrained(folder, local_files_only=True))


def run_job(loaded: Loaded, body: dict) -> tuple[Generation, dict[str, torch.Tensor]]:
    """The job as its worker runs it alone; its tensors as its file names them."""
    req = JobRequest.model_validate({"model": "m", "max_tokens": NEW_TOKENS, **body})
    served = loaded.served
    generation = served.run(req, resolve(req.capture, served.info), req.max_tokens)
    return generation, {c.point.name: c.tensor for c in generation.captured}


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], names: dict[str, str]) -> float:
    worst = 0.0
    for name, path in names.items():
        assert got[name].shape == want[path].shape, (name, got[name].shape, want[path].shape)
        worst = max(worst, float((got[name].float() - want[path]).abs().max()))
    return worst


def chat_or_prompt(loaded: Loaded) -> dict:
    return {"messages": MESSAGES} if loaded.served.info.chat_template else {"prompt": PROMPT}


def test_presets_resolve_to_one_module_per_block(loaded: Loaded, record_property):
    info = loaded.served.info
    presets = info.presets
    assert set(presets) == set(loaded.arch.presets), presets  # Arch.presets: a state-space block has no attention
    listed = {m.path for m in info.modules}
    for name, paths in presets.items():
        assert len(paths) == info.num_layers and set(paths) <= listed, (name, paths)
    blocks = presets["residual"]
    for kind in set(presets) - {"residual"}:  # each block's own module, inside that block
        assert all(p.startswith(block + ".") for p, block in zip(presets[kind], blocks, strict=True)), presets[kind]
    record_property("modules_listed", len(info.modules))
    for kind, paths in presets.items():
        record_property(kind, paths[0])

    preset = "mlp" if "mlp" in presets else "residual"
    _, tensors = run_job(loaded, {"prompt": PROMPT, "max_tokens": 2, "capture": {"preset": preset, "layers": [-1, 0]}})
    assert [n for n in tensors if n != "token_ids"] == [presets[preset][0], presets[preset][-1]]


def test_every_module_output_equals_forward_hooks(loaded: Loaded, record_property):
    modules = [m.path for m in loaded.served.info.modules if m.output_dim is not None and m.all_positions]
    body = chat_or_prompt(loaded)
    generation, tensors = run_job(loaded, {**body, "capture": {"modules": modules}})
    prompt = body.get("messages", PROMPT)
    ids, rows, prompt_tokens = hooked_generate(loaded.model, loaded.tokenizer, prompt, NEW_TOKENS, modules)
    assert torch.equal(generation.token_ids, ids)
    new_tokens = len(ids) - prompt_tokens
    want = {p: select(rows[p], "all", prompt_tokens, new_tokens) for p in modules}
    worst = max_diff(tensors, want, {p: p for p in modules})
    record_property("max_abs_output", worst)
    assert worst == 0.0, f"{loaded.arch.key}: output captures differ from forward hooks by {worst}"


def test_every_module_input_equals_forward_hooks(loaded: Loaded, record_property):
    modules = [m.path for m in loaded.served.info.modules if m.input_dim is not None and m.all_positions]
    body = chat_or_prompt(loaded)
    generation, tensors = run_job(loaded, {**body, "capture": {"modules": modules, "hook": "input"}})
    prompt = body.get("messages", PROMPT)
    ids, rows, prompt_tokens = hooked_generate(
        loaded.model, loaded.tokenizer, prompt, NEW_TOKENS, modules, hook="input"
    )
    assert torch.equal(generation.token_ids, ids)
    new_tokens = len(ids) - prompt_tokens
    want = {p: select(rows[p], "all", prompt_tokens, new_tokens) for p in modules}
    worst = max_diff(tensors, want, {f"{p}:input": p for p in modules})
    record_property("max_abs_input", worst)
    assert worst == 0.0, f"{loaded.arch.key}: input captures differ from forward hooks by {worst}"


def test_a_raw_prompt_runs_and_captures_the_generated_rows_of_every_module(loaded: Loaded, record_property):
    """`prompt` is tokenized as `tokenizer(text)` (no template); `generated` rows include modules
    that only see the last position (the LM head)."""
    table = {m.path: m for m in loaded.served.info.modules}
    modules = [p for p, m in table.items() if m.output_dim is not None]
    generation, tensors = run_job(loaded, {"prompt": PROMPT, "capture": {"modules": modules, "positions": "generated"}})
    ids, rows, prompt_tokens = hooked_generate(loaded.model, loaded.tokenizer, PROMPT, NEW_TOKENS, modules)
    assert torch.equal(generation.token_ids, ids)
    assert generation.prompt_tokens == prompt_tokens == len(loaded.tokenizer(PROMPT)["input_ids"])
    new_tokens = len(ids) - prompt_tokens
    want = {
        p: select(rows[p], "generated", prompt_tokens, new_tokens) if table[p].all_positions else rows[p]
        for p in modules
    }
    worst = max_diff(tensors, want, {p: p for p in modules})
    record_property("raw_prompt_ok", worst == 0.0)
    assert worst == 0.0, f"{loaded.arch.key}: raw-prompt captures differ from forward hooks by {worst}"


def test_a_preset_the_model_lacks_or_a_layer_past_its_depth_is_refused(loaded: Loaded):
    """What the API answers 422 with (tests/e2e/test_architectures.py sends them over HTTP)."""
    depth = loaded.served.info.num_layers
    for capture, message in (
        ({"preset": "heads"}, "has no preset 'heads'"),
        ({"preset": "residual", "layers": [depth]}, f"layer {depth} is out of range"),
    ):
        req = JobRequest.model_validate({"model": "m", "prompt": PROMPT, "capture": capture})
        with pytest.raises(CaptureSpecError, match=message):
            resolve(req.capture, loaded.served.info)


def test_a_base_model_says_it_has_no_chat_template(loaded: Loaded):
    assert loaded.served.info.chat_template is (loaded.arch.key not in BASE_MODELS)

"""nnsight as a second, independent reference for `add`, `zero` and `patch`: the same edit written
with nnsight 0.8 on the engine's own Hugging Face model (wrapped, so one copy of the weights), a
greedy generate of the same chat prompt with the edit applied at the prompt pass and at every
decoding step (`for step in tracer.iter[:n]`, writing the module's `.output`), the captures
taken by `tracer.cache` (which records values after the edits). The job through actq's engine
must give the same tokens and, within 1e-5 of their scale, the same captured values; and the
edit must change something, so a no-op cannot pass.

Positions as actq's (shared/interventions.py): the prompt pass feeds positions 0..P-1, decoding
step k >= 1 feeds position P - 1 + k."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.worker.test_edits import MESSAGES, OTHER, Stored, load_engine, request, run, selected, vector

pytestmark = pytest.mark.model

CAPTURE = ["model.layers.1", "model.layers.2", "model.norm"]
NEW_TOKENS = 8

# (the module's value [1, S, W], the rows of it to edit, their positions) -> the edited value
Edit = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


@pytest.fixture(scope="module")
def wrapped(served):
    """The engine's loaded model inside nnsight: the same module object, not a second copy.
    Wrapping sets an instance `forward` on every module (nnsight's pass-through outside a trace),
    so this module's engine is its own, not shared with other test files."""
    pytest.importorskip("nnsight")
    from nnsight.modeling.transformers import TransformersModel

    model = TransformersModel(served.hf, task="text-generation", tokenizer=served.tokenizer)
    assert model._module is served.hf
    return model


def nnsight_generate(model, tokenizer, messages, new_tokens: int, module: str, edit: Edit, chosen: set[int]):
    """Greedy generate with `edit` on `module`'s output at the positions `chosen`, at the prompt
    pass and every decoding step; returns (token_ids [P+N], {path: [P+N-1, W]}, P)."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    prompt = int(encoded["input_ids"].shape[1])
    target = model.get(module)
    with model.generate(dict(encoded), max_new_tokens=new_tokens, do_sample=False) as tracer:
        cache = tracer.cache(modules=[model.get(path) for path in CAPTURE])
        for step in tracer.iter[:new_tokens]:
            positions = list(range(prompt)) if step == 0 else [prompt - 1 + step]
            at = [s for s, p in enumerate(positions) if p in chosen]
            if at:
                target.output = edit(target.output, at, positions)
        ids = tracer.result.save()
    steps = {path: cache["model." + path].output for path in CAPTURE}  # one tensor per forward step
    rows = {path: torch.cat([v.float().reshape(-1, v.shape[-1]) for v in steps[path]]) for path in CAPTURE}
    return ids[0], rows, prompt


def add(v: torch.Tensor, coeff: float) -> Edit:
    def edit(value, at, _positions):
        out = value.clone()
        out[0, at] = value[0, at] + coeff * v.to(value.dtype)
        return out

    return edit


def zero(features: list[int]) -> Edit:
    def edit(value, at, _positions):
        out = value.clone()
        out[0, torch.tensor(at)[:, None], torch.tensor(features)[None, :]] = 0.0
        return out

    return edit


def patch(rows: torch.Tensor, first: int) -> Edit:
    def edit(value, at, positions):
        out = value.clone()
        out[0, at] = rows[[positions[s] - first for s in at]].to(value.dtype)
        return out

    return edit


def check(served, wrapped, edit: dict, nn_edit: Edit, positions, refs=None, messages=MESSAGES) -> None:
    """The job through actq against nnsight: same tokens, captured values within 1e-5 of their
    scale; and the edit changed the captures (against the same job unedited)."""
    capture = {"modules": CAPTURE, "positions": "all"}
    plain = run(served, request(messages, None, capture), NEW_TOKENS)
    got = run(served, request(messages, [edit], capture), NEW_TOKENS, refs)
    assert got.completion_tokens == NEW_TOKENS  # no early end: nnsight's step loop runs NEW_TOKENS steps
    chosen = selected(positions, got.prompt_tokens, NEW_TOKENS)
    ids, rows, prompt = nnsight_generate(
        wrapped, served.tokenizer, messages, NEW_TOKENS, edit["module"], nn_edit, chosen
    )
    assert prompt == got.prompt_tokens
    assert got.token_ids.tolist() == ids.tolist()
    for tensor in got.captured:
        want = rows[tensor.point.module]
        assert tensor.tensor.shape == want.shape, (tensor.point.name, tensor.tensor.shape, want.shape)
        scale = float(want.abs().max())
        diff = float((tensor.tensor.float() - want).abs().max())
        assert diff <= 1e-5 * scale, (tensor.point.name, diff, scale)
    changed = [
        a.point.module for a, b in zip(got.captured, plain.captured, strict=True) if not torch.equal(a.tensor, b.tensor)
    ]
    assert changed, f"{edit['op']} changed nothing"
    assert sum(got.interventions[0].applied) == len(chosen)


def test_add_equals_nnsight(served, wrapped):
    v = vector(served.info.hidden_size, 1)
    edit = {"module": "model.layers.1", "op": "add", "vector": v, "coeff": 3.0}
    check(served, wrapped, edit, add(torch.tensor(v), 3.0), "all")


def test_zero_equals_nnsight(served, wrapped):
    edit = {"module": "model.layers.2", "op": "zero", "features": [0, 5, 9], "positions": "prompt"}
    check(served, wrapped, edit, zero([0, 5, 9]), "prompt")


def test_patch_equals_nnsight(served, wrapped):
    source = run(served, request(OTHER, None, {"modules": ["model.layers.1"], "positions": "all"}), 4)
    rows = source.captured[0].tensor
    prompt = run(served, request(MESSAGES, None, None), 1).prompt_tokens
    assert prompt <= rows.shape[0]  # the source's rows cover the patched positions (the last 3 of the prompt)
    edit = {
        "module": "model.layers.1",
        "op": "patch",
        "source": {"job": "0" * 8 + "-0000-4000-8000-" + "0" * 12, "tensor": "model.layers.1"},
        "positions": {"prompt": ["-3:"]},
    }
    check(served, wrapped, edit, patch(rows.float(), 0), {"prompt": ["-3:"]}, refs=Stored(0, rows.numpy()))

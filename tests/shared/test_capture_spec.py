"""The capture-path grammar and the size estimate (pure functions, no model)."""

from __future__ import annotations

import re

import pytest

from shared.capture_spec import (
    MemoryEstimate,
    check_budget,
    estimate,
    parse_all,
    prompt_tokens_lower_bound,
    prompt_tokens_upper_bound,
    resolve,
)
from shared.errors import CaptureSpecError, CaptureTooLarge, JobTooLarge
from shared.schemas import CaptureSpec, JobRequest, ModelInfo, ModuleInfo


def _model() -> ModelInfo:
    modules = [ModuleInfo(path="model.embed_tokens", output_dim=8, input_dim=None, all_positions=True)]
    for i in range(12):
        modules += [
            ModuleInfo(path=f"model.layers.{i}", output_dim=8, input_dim=8, all_positions=True),
            ModuleInfo(path=f"model.layers.{i}.input_layernorm", output_dim=8, input_dim=8, all_positions=True),
            ModuleInfo(path=f"model.layers.{i}.mlp", output_dim=8, input_dim=8, all_positions=True),
        ]
    modules += [
        ModuleInfo(path="model.norm", output_dim=8, input_dim=8, all_positions=True),
        ModuleInfo(path="lm_head", output_dim=100, input_dim=8, all_positions=False),
    ]
    return ModelInfo(
        name="m",
        source="x",
        architecture="A",
        num_layers=12,
        hidden_size=8,
        vocab_size=100,
        max_context=64,
        dtype="float32",
        device="cpu",
        modules=modules,
        presets={
            "residual": [f"model.layers.{i}" for i in range(12)],
            "mlp": [f"model.layers.{i}.mlp" for i in range(12)],
        },
    )


MODEL = _model()


def names(*patterns: str, **spec) -> list[str]:
    return [p.name for p in resolve(CaptureSpec(modules=list(patterns), **spec), MODEL)]


def test_index_lists_wildcards_and_forward_order():
    assert names("model.layers.{8,2}.input_layernorm") == [
        "model.layers.2.input_layernorm",
        "model.layers.8.input_layernorm",
    ]
    assert names("model.layers.*") == [f"model.layers.{i}" for i in range(12)]
    assert names("model.layers.*.mlp", "model.layers.3.mlp", "model.norm") == [
        f"model.layers.{i}.mlp" for i in range(12)
    ] + ["model.norm"]
    assert names("model.layers.{0,1}", hook="input") == ["model.layers.0:input", "model.layers.1:input"]


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("model.layers.99", "'model.layers.99' names no module"),
        ("model.layers.{1,99}", "'model.layers.99' names no module"),
        ("model.layrs.3", "closest valid names: model.layers.3"),
        ("model.layers.0.__dict__", "segment '__dict__' is not a name"),
        ("__class__.__init__.__globals__", "segment '__class__' is not a name"),
        ("model.layers[0]", "segment 'layers[0]' is not a name"),
        ("model..layers", "segment '' is not a name"),
        ("model.layers.{}", "segment '{}'"),
        ("model.layers.0; import os", "is not a name"),
        (".".join(["{" + ",".join(map(str, range(20))) + "}"] * 3), "expands to 8000 paths"),
    ],
)
def test_bad_paths_are_refused_with_what_to_fix(pattern, message):
    with pytest.raises(
        CaptureSpecError, match=message.replace("[", r"\[").replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")
    ):
        names(pattern)


def test_many_patterns_cannot_multiply_the_work():
    distinct = ["model.layers.{" + ",".join(map(str, range(k, k + 20))) + "}.mlp" for k in range(256)]  # 20 x 256
    with pytest.raises(CaptureSpecError, match="more than 4096 concrete paths"):
        names(*distinct)
    ten = "model." + ".".join(["{" + ",".join(map(str, range(10))) + "}"] * 10)  # 10^10 paths
    with pytest.raises(CaptureSpecError, match="expands to 10000000000 paths"):
        parse_all([ten] * 200)


def test_repeated_patterns_count_once():
    pattern = "model.layers.{" + ",".join(map(str, range(20))) + "}.mlp"
    assert parse_all([pattern] * 256) == parse_all([pattern])
    assert len(parse_all([pattern] * 256)) == 20


def test_modules_without_a_capturable_side_or_position_are_refused():
    with pytest.raises(CaptureSpecError, match="has no capturable input"):
        names("model.embed_tokens", hook="input")
    with pytest.raises(CaptureSpecError, match="only computes the last position"):
        names("lm_head", positions="all")
    assert names("lm_head", positions="generated") == ["lm_head"]


def test_capture_estimate_is_positions_times_width_times_dtype_bytes():
    request = JobRequest(
        model="m",
        messages=[{"role": "user", "content": "abcd"}],
        capture={"modules": ["model.layers.{0,1}", "lm_head"], "positions": "generated", "dtype": "float16"},
    )
    points = resolve(request.capture, MODEL)
    assert estimate(request, points, MODEL, max_tokens=10).capture == 10 * (8 + 8 + 100) * 2
    request.capture.positions = "last"
    assert estimate(request, points, MODEL, max_tokens=10).capture == 1 * 116 * 2
    request.capture.positions = "prompt"
    prompt = prompt_tokens_upper_bound(request, MODEL)
    assert estimate(request, points, MODEL, max_tokens=10).capture == prompt * 116 * 2
    assert prompt >= 4 + 16


def test_working_memory_is_kv_cache_per_token_plus_prefill_activations():
    """KV cache for every prompt and generated token, activations for the prompt, and attention
    scores per (query, key) pair where the worker says they are materialised."""
    model = MODEL.model_copy(update={"kv_bytes_per_token": 100, "activation_bytes_per_token": 10})
    request = JobRequest(model="m", messages=[{"role": "user", "content": "abcd"}])
    prompt = prompt_tokens_upper_bound(request, model)
    assert estimate(request, [], model, max_tokens=7) == MemoryEstimate(0, 100 * (prompt + 7) + 10 * prompt)
    eager = model.model_copy(update={"attention_bytes_per_token_pair": 3})
    assert estimate(request, [], eager, max_tokens=7).working == 100 * (prompt + 7) + 10 * prompt + 3 * prompt**2
    assert estimate(request, [], MODEL, max_tokens=7) == MemoryEstimate(0, 0)  # a worker that did not publish


def test_a_text_fed_in_chunks_holds_one_chunk_s_activations_scores_and_logits():
    """With `prefill_chunk_tokens` published, one pass holds at most a chunk of positions: the
    activations and logits of a chunk, the scores of a chunk against every earlier position; the
    KV cache still covers every token. A trace that asks for log-probabilities, or captures a
    module generation runs at the last position only (lm_head), holds the logits of its pass
    and the log-softmax of SCORE_ROWS of them; a generation never does."""
    from shared.capture_spec import SCORE_ROWS, all_logits, working_bytes

    model = MODEL.model_copy(
        update={"kv_bytes_per_token": 100, "activation_bytes_per_token": 10, "attention_bytes_per_token_pair": 3}
    )
    chunked = model.model_copy(update={"prefill_chunk_tokens": 16})
    assert working_bytes(chunked, 40, 5) == 100 * 45 + 10 * 16 + 3 * 16 * 40
    assert working_bytes(chunked, 12, 5) == working_bytes(model, 12, 5) == 100 * 17 + 10 * 12 + 3 * 12 * 12
    logits = 4 * 100 * (16 + 2 * min(16, SCORE_ROWS))
    assert working_bytes(chunked, 40, 0, all_logits=True) == working_bytes(chunked, 40, 0) + logits
    assert all_logits(True, True, [], MODEL) and all_logits(True, False, ["lm_head"], MODEL)
    assert not all_logits(True, False, ["model.norm"], MODEL) and not all_logits(False, True, ["lm_head"], MODEL)


def test_the_prompt_bound_never_exceeds_what_the_context_leaves():
    model = MODEL.model_copy(update={"max_context": 64, "kv_bytes_per_token": 1})
    request = JobRequest(model="m", messages=[{"role": "user", "content": "x" * 10_000}])
    assert estimate(request, [], model, max_tokens=4).working == 64


def test_budgets():
    check_budget(MemoryEstimate(100, 50), capture_budget=100, memory_budget=150)
    with pytest.raises(CaptureTooLarge, match="estimated capture size 101 bytes exceeds the budget of 100 bytes"):
        check_budget(MemoryEstimate(101, 0), capture_budget=100, memory_budget=1000)
    with pytest.raises(JobTooLarge, match=r"estimated 151 bytes of worker memory \(capture 100, KV cache and"):
        check_budget(MemoryEstimate(100, 51), capture_budget=100, memory_budget=150)


def test_the_expansion_is_counted_before_any_path_is_built(monkeypatch):
    """256 patterns that each expand to 4,096 paths (a million in all) are refused from the
    count alone: no path is built, so the API's event loop is never held by one request."""
    from shared import capture_spec

    built = []
    monkeypatch.setattr(capture_spec.itertools, "product", lambda *a: built.append(a) or iter(()))
    sixteen = "{" + ",".join(map(str, range(16))) + "}"

    def big(k: int) -> str:  # 16**3 = 4,096 paths, a different first set for each k
        return "model.layers.{" + ",".join(map(str, range(k, k + 16))) + f"}}.mlp.{sixteen}.up.{sixteen}"

    spec = CaptureSpec(modules=[big(k) for k in range(256)])
    with pytest.raises(CaptureSpecError, match="expands to more than 4096 concrete paths"):
        capture_spec.resolve(spec, MODEL)
    assert built == []


def test_wildcards_match_through_the_shape_index():
    spec = CaptureSpec(modules=["model.layers.*", "model.layers.*.mlp"])
    expected = [path for i in range(12) for path in (f"model.layers.{i}", f"model.layers.{i}.mlp")]
    assert [p.module for p in resolve(spec, MODEL)] == expected
    assert MODEL.shape_index["model.layers.*.mlp"] == [f"model.layers.{i}.mlp" for i in range(12)]


def _names(**spec) -> list[str]:
    return [p.name for p in resolve(CaptureSpec(**spec), MODEL)]


def test_a_preset_names_one_module_per_block_at_the_layers_asked_in_forward_order():
    assert _names(preset="residual") == [f"model.layers.{i}" for i in range(12)]
    assert _names(preset="residual", layers=[-1, 3, 0]) == ["model.layers.0", "model.layers.3", "model.layers.11"]
    assert _names(preset="mlp", layers=[2], hook="input") == ["model.layers.2.mlp:input"]
    # with modules: the union, each module once, still in forward order
    both = _names(preset="residual", layers=[1], modules=["model.layers.{1,2}", "model.norm"])
    assert both == ["model.layers.1", "model.layers.2", "model.norm"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"preset": "attention"}, "model 'm' has no preset 'attention'; its presets: mlp, residual"),
        ({"preset": "residual", "layers": [12]}, "layer 12 is out of range for preset 'residual'"),
        ({"preset": "residual", "layers": [-13]}, "model 'm' has 12 layers (0 to 11, or -1 for the last)"),
    ],
)
def test_a_preset_the_model_cannot_resolve_is_refused(spec, message):
    with pytest.raises(CaptureSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(CaptureSpec(**spec), MODEL)


def test_a_raw_prompt_is_bounded_by_its_bytes_with_no_template_tokens():
    request = JobRequest(model="m", prompt="x" * 40)
    chat = JobRequest(model="m", messages=[{"role": "user", "content": "x" * 40}])
    assert prompt_tokens_upper_bound(request, MODEL) == 40 + 8  # a BOS or two, well inside the slack
    assert prompt_tokens_upper_bound(chat, MODEL) > prompt_tokens_upper_bound(request, MODEL)
    bytes_per_token = MODEL.model_copy(update={"max_token_bytes": 16})
    assert prompt_tokens_lower_bound(request, bytes_per_token) == 3  # ceil(40 / 16)


@pytest.mark.parametrize(
    "fields",
    [{}, {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}],
    ids=["neither", "both"],
)
def test_a_request_gives_exactly_one_of_prompt_and_messages(fields):
    with pytest.raises(ValueError, match="give exactly one of `messages`"):
        JobRequest(model="m", **fields)


def _spelled_out(pattern: str, paths: list[str]) -> list[str] | str:
    """The reference: expand every set by hand and look each spelling up; the first one that names
    nothing is returned as a string."""
    import itertools
    import re

    choices = [
        [str(int(i)) for i in seg[1:-1].split(",")] if seg.startswith("{") else [seg] for seg in pattern.split(".")
    ]
    found: list[str] = []
    for combo in itertools.product(*choices):
        regex = re.compile(r"\.".join(r"\d+" if s == "*" else re.escape(s) for s in combo))
        hits = [p for p in paths if regex.fullmatch(p)]
        if not hits:
            return ".".join(combo)
        found += [h for h in hits if h not in found]
    return found


@pytest.mark.parametrize(
    "pattern",
    [
        "model.layers.{0,3,11}",
        "model.layers.{11,0,0}.mlp",
        "model.layers.*.mlp",
        "model.layers.{0,99}.mlp",
        "model.layers.{5,7}.*",
        "model.{0,1}",
        "model.layers.007",
        "model.layers.{2,4,6,8,10,12}.input_layernorm",
    ],
)
def test_sets_are_matched_as_an_expansion_would_match_them(pattern):
    """`names` compares sets by membership, without expanding them: the same modules as spelling
    every path out, and the same first path that names nothing."""
    from shared.capture_spec import check_patterns
    from shared.capture_spec import names as match

    expected = _spelled_out(pattern, [m.path for m in MODEL.modules])
    if isinstance(expected, str):
        with pytest.raises(CaptureSpecError, match=f"capture path '{re.escape(expected)}' names no module"):
            match(check_patterns([pattern])[0], MODEL)
    else:
        assert sorted(match(check_patterns([pattern])[0], MODEL)) == sorted(expected)

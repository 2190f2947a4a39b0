"""What an nnsight request must pass before anything is stored (api/nnsight_checks.py), alone."""

from __future__ import annotations

import json

import pytest

from api import nnsight_checks as checks
from api import nnsight_identity
from shared.errors import BadRequest
from shared.schemas import ModelInfo


def info(**fields) -> ModelInfo:
    base = {
        "name": "smollm2-135m",
        "source": "/cache/actq/models/smollm2-135m",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "architecture": "LlamaForCausalLM",
        "num_layers": 30,
        "hidden_size": 576,
        "vocab_size": 49152,
        "max_context": 8192,
        "dtype": "float32",
        "device": "cpu",
        "modules": [],
        "nnsight_version": "0.8.1",
        "python_version": "3.11.9",
        "attention": "sdpa",
    }
    return ModelInfo.model_validate({**base, **fields})


@pytest.mark.parametrize(
    ("name", "source", "says"),
    [
        ("smollm2-135m", "/cache/actq/models/smollm2-135m", None),  # its own name
        ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", None),  # the Hub id its worker loaded: those weights
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "/cache/actq/models/smollm2-135m", "does not serve its weights"),
        ("HuggingFaceTB/SmolLM2-360M-Instruct", "/cache/actq/models/smollm2-135m", "not served here"),
        ("someone/smollm2-135m", "/cache/actq/models/smollm2-135m", "not served here"),  # a Hub id's last part
    ],
)
def test_a_name_identifies_the_served_model_only_as_its_name_or_the_hub_id_it_was_loaded_by(name, source, says):
    """A Hub id the model was only made from (the built-in: a Q4_1 GGUF of it, dequantized) is not its weights."""
    served = info(source=source)
    if says is None:
        assert nnsight_identity.served_as(name, [served]) is served
    else:
        with pytest.raises(BadRequest, match=says):
            nnsight_identity.served_as(name, [served])


def test_the_model_key_is_nnsights_and_carries_a_repo_id():
    key = "nnsight.modeling.transformers.TransformersModel:" + json.dumps({"repo_id": "x/y", "revision": None})
    assert checks.repo_id(key) == ("x/y", None)
    for bad in ("x/y", "nnsight.modeling.vllm.VLLM:{}", "nnsight.modeling.language.LanguageModel:not json"):
        with pytest.raises(BadRequest):
            checks.repo_id(bad)


@pytest.mark.parametrize(
    ("nnsight", "python", "says"),
    [
        ("0.8.1", "3.11.4 (main, Jun  7 2023) [GCC 12.2.0]", None),  # patch versions may differ
        ("0.8.0rc1", "3.11.9", None),
        ("0.7.3", "3.11.9", "install nnsight==0.8.1"),
        (None, "3.11.9", "nnsight-version"),
        ("0.8.1", "3.12.1 (main)", "use Python 3.11"),
        ("0.8.1", None, "does not say its Python version"),
        ("0.8.1", "", "does not say its Python version"),
    ],
)
def test_versions_match_to_the_minor(nnsight, python, says):
    if says is None:
        checks.check_versions(nnsight, python, info())
    else:
        with pytest.raises(BadRequest, match=says.replace(".", r"\.")):
            checks.check_versions(nnsight, python, info())


def test_a_worker_without_nnsight_refuses():
    with pytest.raises(BadRequest, match="do not have nnsight installed"):
        checks.check_versions("0.8.1", "3.11.9", info(nnsight_version=None))


def test_only_the_workers_own_attention_travels_in_the_env():
    checks.check_env({}, info())
    checks.check_env({"attn_implementation": "sdpa"}, info())
    with pytest.raises(BadRequest, match="attn_implementation='sdpa'"):
        checks.check_env({"attn_implementation": "eager"}, info())
    with pytest.raises(BadRequest, match="peft"):
        checks.check_env({"attn_implementation": "sdpa", "peft": "me/adapter"}, info())


def test_the_envelope_is_read_as_json_and_bounded():
    assert checks.envelope('{"model_key": "k", "session_id": "s", "compress": true, "env": {}}').compress is True
    for raw, says in ((None, "multipart form"), ("{", "not nnsight's request envelope"), ("x" * 200_000, "over")):
        with pytest.raises(BadRequest, match=says):
            checks.envelope(raw)

"""Trace jobs, log-probabilities and reductions through the real stack (HTTP -> Redis -> Celery
worker -> safetensors -> HTTP), against an independent reference: a plain `model(input_ids)` with
forward hooks on the plain Hugging Face model, and log_softmax of its logits."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.reference import hooked_forward, reference_logprobs
from tests.support.stack import TINY

CONVERSATION = [
    {"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have?"},
    {"role": "assistant", "content": "He has 3 + 5 = 8 apples. The answer is 8."},
]
POINTS = ["model.layers.{1,3}", "model.layers.2.mlp"]


@pytest.fixture(scope="module")
def reference_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def trace(http, live, capture: dict | None = None, **fields) -> tuple[dict, dict]:
    body = {"model": TINY, "mode": "trace", "messages": CONVERSATION, "capture": capture, **fields}
    response = http.post("/jobs", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 202, response.text
    job = live.wait(http, response.json()["id"])
    assert job["status"] == "succeeded", job
    tensors = load_safetensors(http.get(job["activations"]["download_url"]).content) if job["activations"] else {}
    return job, tensors


def test_a_trace_job_captures_and_scores_the_given_text(live, http, reference_model):
    """Tokens: the chat template's rendering of the whole conversation; every captured row equals
    the forward hook's; logprobs (result and file) equal log_softmax of the plain forward's logits
    to 1e-5; completion_span is the assistant turn through its end-of-turn token."""
    model, tokenizer = reference_model
    capture = {"modules": POINTS, "positions": "all", "dtype": "float32"}
    job, tensors = trace(http, live, capture, logprobs=True, top_logprobs=2)
    ids = tokenizer.apply_chat_template(CONVERSATION, return_dict=True)["input_ids"]
    before = tokenizer.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True, return_dict=True)
    start = len(before["input_ids"])
    stop = ids.index(model.generation_config.eos_token_id, start) + 1
    result = http.get(f"/jobs/{job['id']}/result").json()  # the whole result, entries included
    assert result["text"] == "" and result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert result["completion_span"] == [start, stop]
    assert tensors["token_ids"].tolist() == ids
    modules = [t["module"] for t in job["activations"]["tensors"]]
    rows, logits = hooked_forward(model, torch.tensor([ids]), modules)
    for info in job["activations"]["tensors"]:
        assert (info["start"], info["stop"], info["reduce"], info["features"]) == (0, len(ids), "none", None)
        assert torch.equal(tensors[info["name"]], rows[info["module"]]), info["name"]
    values, top_values, top_ids = reference_logprobs(logits, torch.tensor(ids), first=1, k=2)
    content = result["logprobs"]["content"]
    assert [c["token_id"] for c in content] == ids and content[0]["logprob"] is None
    got = torch.tensor([c["logprob"] for c in content[1:]])
    assert float((got - values).abs().max()) <= 1e-5
    assert [[t["token_id"] for t in c["top_logprobs"]] for c in content[1:]] == top_ids.tolist()
    assert result["logprobs"]["total"] == pytest.approx(float(values.sum()), abs=1e-4)
    assert result["logprobs"]["completion_total"] == pytest.approx(float(values[start - 1 : stop - 1].sum()), abs=1e-4)
    assert set(job["activations"]["extra"]) == {
        "logprobs",
        "logprob_token_ids",
        "logprob_ranks",
        "top_logprobs",
        "top_logprob_ids",
    }
    assert torch.isnan(tensors["logprobs"][0]) and torch.allclose(tensors["logprobs"][1:], values, atol=1e-5, rtol=0)
    assert torch.equal(tensors["top_logprob_ids"][1:], top_ids)
    one = http.get(f"/jobs/{job['id']}/activations/logprobs")  # the extra tensors download one by one too
    assert one.status_code == 200
    assert torch.equal(load_safetensors(one.content)["logprobs"][1:], tensors["logprobs"][1:])


def test_a_reduced_capture_equals_the_reduction_of_the_full_one(live, http):
    """Completion positions, features [5, 0, 40] and each reduction: the stored row is that
    reduction of the full capture's rows and columns; the manifest says what was done."""
    capture = {"modules": POINTS, "positions": "completion", "dtype": "float32"}
    full_job, full = trace(http, live, capture)
    start, stop = full_job["result"]["completion_span"]
    for reduce, fold in (("mean", lambda r: r.mean(0)), ("max", lambda r: r.amax(0)), ("last", lambda r: r[-1])):
        job, reduced = trace(http, live, {**capture, "reduce": reduce, "features": [5, 0, 40]})
        for info in job["activations"]["tensors"]:
            assert info["shape"] == [1, 3] and info["reduce"] == reduce and info["features"] == [5, 0, 40]
            assert (info["start"], info["stop"]) == (start, stop)
            expected = fold(full[info["name"]][:, [5, 0, 40]])
            assert torch.allclose(reduced[info["name"]][0], expected, rtol=1e-5, atol=1e-6), (reduce, info["name"])


def test_a_trace_without_capture_or_logprobs_still_reports_its_tokens(live, http):
    job, tensors = trace(http, live)
    assert job["activations"] is None and tensors == {} and job["result"]["logprobs"] is None
    assert job["result"]["usage"]["prompt_tokens"] > 0


def test_a_generation_job_returns_its_tokens_log_probabilities(live, http, reference_model):
    model, _ = reference_model
    body = {"model": TINY, "messages": CONVERSATION[:1], "max_tokens": 6, "logprobs": True, "top_logprobs": 4}
    job = live.wait(http, http.post("/jobs", json=body).json()["id"])
    assert job["status"] == "succeeded", job
    content = http.get(f"/jobs/{job['id']}/result").json()["logprobs"]["content"]
    assert len(content) == job["result"]["usage"]["completion_tokens"] == 6
    for entry in content:  # greedy: the chosen token is the likeliest
        assert entry["token_id"] == entry["top_logprobs"][0]["token_id"] and len(entry["top_logprobs"]) == 4
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
    assert job["activations"] is None  # no capture, and 6 entries are inline

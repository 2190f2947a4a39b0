"""Interventions through the real stack (HTTP -> Redis -> Celery worker -> safetensors -> HTTP),
against the independent reference (tests/support/edit_reference.py: forward hooks that edit a
plain Hugging Face generate): a steered job with its unedited baseline in one request, a vector
from an uploaded set, a vector taken from an earlier job's captured rows, activation patching
from an earlier job, and the OpenAI route. nnsight, the library the original design named, is a
second reference for add, zero and patch where it installs (tests/worker/test_edits_nnsight.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import save
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import edit_reference as ref
from tests.support.stack import TINY

MESSAGES = [{"role": "user", "content": "Name three colours."}]
OTHER = [{"role": "user", "content": "Name three fruits."}]
CAPTURE = {"modules": ["model.layers.2", "model.norm"], "positions": "all"}
EVERYWHERE = set(range(100_000))


@pytest.fixture(scope="module")
def reference_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def steer(width: int, seed: int, scale: float = 1.0) -> list[float]:
    return (torch.randn(width, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


def run(http, live, **fields) -> tuple[dict, dict]:
    body = {"model": TINY, "messages": MESSAGES, "max_tokens": 8, **fields}
    response = http.post("/jobs", json=body)
    assert response.status_code == 202, response.text
    job = live.wait(http, response.json()["id"])
    assert job["status"] == "succeeded", job
    tensors = load_safetensors(http.get(job["activations"]["download_url"]).content) if job["activations"] else {}
    return job, tensors


def assert_matches(tensors: dict, rows: dict, prefix: str = "") -> None:
    for path, want in rows.items():
        got = tensors[prefix + path]
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (prefix, path)


def test_steered_and_baseline_texts_in_one_request(live, http, reference_model):
    """One `add` at two layers with `baseline: true`: the steered text and captures equal the
    edited reference, the baseline's equal the plain model's, and per-step counts are reported."""
    model, tokenizer = reference_model
    width = model.config.hidden_size
    vector = steer(width, 1, 0.5)
    edits = [{"module": "model.layers.{1,2}", "op": "add", "vector": vector, "coeff": 6.0}]
    job, tensors = run(http, live, interventions=edits, baseline=True, capture=CAPTURE)
    edit = ref.add(torch.tensor(vector), 6.0, EVERYWHERE)
    ids, rows, _ = ref.edited_generate(
        model, tokenizer, MESSAGES, 8, [(f"model.layers.{i}", "output", edit) for i in (1, 2)], CAPTURE["modules"]
    )
    plain_ids, plain_rows, _ = ref.edited_generate(model, tokenizer, MESSAGES, 8, [], CAPTURE["modules"])
    result = job["result"]
    assert tensors["token_ids"].tolist() == ids.tolist()
    assert tensors["baseline/token_ids"].tolist() == plain_ids.tolist()
    assert ids.tolist() != plain_ids.tolist()  # the edit changes the answer
    assert result["text"] == tokenizer.decode(
        ids[len(ids) - result["usage"]["completion_tokens"] :], skip_special_tokens=True
    )
    assert (
        result["baseline"]["usage"]["completion_tokens"]
        == len(plain_ids) - result["baseline"]["usage"]["prompt_tokens"]
    )
    assert_matches(tensors, rows)
    assert_matches(tensors, plain_rows, "baseline/")
    names = {t["name"]: t["baseline"] for t in job["activations"]["tensors"]}
    assert names == {
        "model.layers.2": False,
        "model.norm": False,
        "baseline/model.layers.2": True,
        "baseline/model.norm": True,
    }
    reports = result["interventions"]
    prompt = result["usage"]["prompt_tokens"]
    assert [(r["index"], r["module"], r["op"]) for r in reports] == [
        (0, "model.layers.1", "add"),
        (0, "model.layers.2", "add"),
    ]
    steps = result["usage"]["completion_tokens"]
    assert all(r["applied"] == [prompt] + [1] * (steps - 1) for r in reports)


def test_vectors_from_a_vector_set_and_from_an_earlier_job(live, http, reference_model):
    model, tokenizer = reference_model
    width = model.config.hidden_size
    values = np.asarray(steer(width, 2), dtype=np.float32)
    uploaded = http.post("/vectors", content=save({"happy": np.stack([values, -values])}))
    assert uploaded.status_code == 201, uploaded.text
    named = {"vector_id": uploaded.json()["id"], "name": "happy", "row": 1}
    job, tensors = run(
        http,
        live,
        interventions=[{"module": "model.layers.1", "op": "add", "vector": named, "coeff": 3.0}],
        capture=CAPTURE,
    )
    ids, rows, _ = ref.edited_generate(
        model,
        tokenizer,
        MESSAGES,
        8,
        [("model.layers.1", "output", ref.add(torch.from_numpy(-values), 3.0, EVERYWHERE))],
        CAPTURE["modules"],
    )
    assert tensors["token_ids"].tolist() == ids.tolist()
    assert_matches(tensors, rows)

    # the mean of an earlier job's rows at layer 2, added at layer 1 of another job
    source, source_tensors = run(http, live, messages=OTHER, capture=CAPTURE)
    mean = source_tensors["model.layers.2"].double().mean(0).float()
    from_job = {"job": source["id"], "tensor": "model.layers.2", "mean": True}
    job, tensors = run(
        http,
        live,
        interventions=[{"module": "model.layers.1", "op": "add", "vector": from_job, "coeff": 0.5}],
        capture=CAPTURE,
    )
    ids, rows, _ = ref.edited_generate(
        model,
        tokenizer,
        MESSAGES,
        8,
        [("model.layers.1", "output", ref.add(mean, 0.5, EVERYWHERE))],
        CAPTURE["modules"],
    )
    assert tensors["token_ids"].tolist() == ids.tolist()
    assert_matches(tensors, rows)


def test_activation_patching_from_an_earlier_job(live, http, reference_model):
    """The classic clean -> corrupted patch: the rows an earlier job captured at layer 1 replace
    this job's at the last prompt positions (both prompts tokenize to the same length)."""
    model, tokenizer = reference_model
    lengths = [
        len(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"])
        for m in (MESSAGES, OTHER)
    ]
    assert lengths[0] == lengths[1]
    source, source_tensors = run(
        http, live, messages=OTHER, capture={"modules": ["model.layers.1"], "positions": "all"}
    )
    patch = {
        "module": "model.layers.1",
        "op": "patch",
        "source": {"job": source["id"], "tensor": "model.layers.1"},
        "positions": {"prompt": ["-6:"]},
    }
    job, tensors = run(http, live, interventions=[patch], capture=CAPTURE)
    prompt = lengths[0]
    chosen = set(range(prompt - 6, prompt))
    edit = ref.patch(source_tensors["model.layers.1"], 0, chosen)
    ids, rows, _ = ref.edited_generate(
        model, tokenizer, MESSAGES, 8, [("model.layers.1", "output", edit)], CAPTURE["modules"]
    )
    assert tensors["token_ids"].tolist() == ids.tolist()
    assert_matches(tensors, rows)
    assert job["result"]["interventions"][0]["applied"][0] == 6


def test_the_openai_route_takes_interventions_and_a_baseline(live, http, reference_model):
    model, tokenizer = reference_model
    vector = steer(model.config.hidden_size, 3, 0.5)
    body = {
        "model": TINY,
        "messages": MESSAGES,
        "max_tokens": 8,
        "interventions": [{"module": "model.layers.2", "op": "add", "vector": vector, "coeff": 6.0}],
        "baseline": True,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert response.headers["x-actq-job-id"] == answer["actq"]["job_id"]  # for clients that drop `actq`
    ids, _, prompt = ref.edited_generate(
        model,
        tokenizer,
        MESSAGES,
        8,
        [("model.layers.2", "output", ref.add(torch.tensor(vector), 6.0, EVERYWHERE))],
        [],
    )
    plain_ids, _, _ = ref.edited_generate(model, tokenizer, MESSAGES, 8, [], [])
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode(ids[prompt:], skip_special_tokens=True)
    assert answer["actq"]["baseline"]["text"] == tokenizer.decode(plain_ids[prompt:], skip_special_tokens=True)
    assert answer["actq"]["interventions"][0]["total"] > 0


def test_the_python_client_uploads_vectors_and_steers(live, reference_model):
    from shared.client import Client, NotFound

    model, tokenizer = reference_model
    values = np.asarray(steer(model.config.hidden_size, 4, 0.5), dtype=np.float32)
    with Client(live.base_url) as client:
        record = client.upload_vectors(save({"v": values}), label="client")
        assert record["tensors"] == {"v": {"shape": [values.shape[0]], "dtype": "F32"}}
        assert record["id"] in [s["id"] for s in client.vector_sets()]
        edit = {
            "module": "model.layers.2",
            "op": "add",
            "vector": {"vector_id": record["id"], "name": "v"},
            "coeff": 6.0,
        }
        job = client.submit(TINY, MESSAGES, max_tokens=8, interventions=[edit], baseline=True)
        job.wait(timeout=120)
        assert job.status == "succeeded", job.data
        ids, _, prompt = ref.edited_generate(
            model,
            tokenizer,
            MESSAGES,
            8,
            [("model.layers.2", "output", ref.add(torch.from_numpy(values), 6.0, EVERYWHERE))],
            [],
        )
        plain_ids, _, _ = ref.edited_generate(model, tokenizer, MESSAGES, 8, [], [])
        assert job.result.text == tokenizer.decode(ids[prompt:], skip_special_tokens=True)
        assert job.result.baseline["text"] == tokenizer.decode(plain_ids[prompt:], skip_special_tokens=True)
        assert job.result.interventions[0]["total"] == prompt + job.result.usage.completion_tokens - 1
        client.delete_vectors(record["id"])
        with pytest.raises(NotFound):
            client.delete_vectors(record["id"])

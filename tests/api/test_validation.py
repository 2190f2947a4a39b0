"""Bad input over HTTP against the live API: a clear 4xx that says what to fix, and nothing enqueued."""

from __future__ import annotations

import time

import pytest

from tests.support.stack import TINY, job_count, queued_messages

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def body(**changes):
    base = {"model": TINY, "messages": MESSAGES, "max_tokens": 8, "capture": {"modules": ["model.layers.1"]}}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


BAD = [
    ("max tokens over limit", body(max_tokens=201), 422, "max_tokens 201 exceeds the limit of 200"),
    ("zero max tokens", body(max_tokens=0), 422, "max_tokens: Input should be greater than or equal to 1"),
    ("unknown model", body(model="gpt-17"), 404, "model 'gpt-17' is not served here; served models:"),
    ("empty messages", body(messages=[]), 422, "messages: List should have at least 1 item"),
    (
        "unknown role",
        body(messages=[{"role": "wizard", "content": "hi"}]),
        422,
        "messages.0.role: Input should be 'system', 'user', 'assistant' or 'tool'",
    ),
    (
        "missing content",
        body(messages=[{"role": "user"}]),
        422,
        "messages.0: Value error, a user message needs `content` (a string)",
    ),
    (
        "bad capture path",
        body(capture={"modules": ["model.layers.9"]}),
        422,
        "'model.layers.9' names no module of model 'tiny'; closest valid names: model.layers.3",
    ),
    ("typo in path", body(capture={"modules": ["model.layyers.1"]}), 422, "closest valid names: model.layers.1"),
    ("dunder path", body(capture={"modules": ["model.layers.0.__dict__"]}), 422, "segment '__dict__' is not a name"),
    ("globals path", body(capture={"modules": ["__class__.__init__.__globals__"]}), 422, "is not a name"),
    (
        "bad dtype",
        body(capture={"modules": ["model.layers.1"], "dtype": "float64"}),
        422,
        "capture.dtype: Input should be 'float32', 'float16' or 'bfloat16'",
    ),
    (
        "bad hook",
        body(capture={"modules": ["model.layers.1"], "hook": "grad"}),
        422,
        "capture.hook: Input should be 'output' or 'input'",
    ),
    (
        "bad positions",
        body(capture={"modules": ["model.layers.1"], "positions": "first"}),
        422,
        "capture.positions: Input should be",
    ),
    (
        "lm_head at every position",
        body(capture={"modules": ["lm_head"]}),
        422,
        "only computes the last position of each step",
    ),
    (
        "no capturable input",
        body(capture={"modules": ["model.embed_tokens"], "hook": "input"}),
        422,
        "has no capturable input",
    ),
    (
        "capture over budget",
        body(max_tokens=200, capture={"modules": ["lm_head"], "positions": "generated"}),
        422,
        "estimated capture size 39,321,600 bytes exceeds the budget of 20,000,000 bytes",
    ),
    ("extra field", body(echo=True), 422, "echo: Extra inputs are not permitted"),
    ("top logprobs over 20", body(logprobs=True, top_logprobs=21), 422, "top_logprobs: Input should be less than"),
    ("top logprobs alone", body(top_logprobs=3), 422, "top_logprobs needs logprobs: true"),
    ("trace with max_tokens", body(mode="trace"), 422, "a trace job generates nothing, so max_tokens cannot apply"),
    (
        "trace with sampling and stop",
        body(mode="trace", max_tokens=None, temperature=0.7, stop=["x"]),
        422,
        "so temperature, stop cannot apply; leave them out",
    ),
    (
        "trace with generated positions",
        body(mode="trace", max_tokens=None, capture={"modules": ["model.layers.1"], "positions": "generated"}),
        422,
        "positions 'generated' selects no token; use 'all', 'prompt', 'last', or 'completion'",
    ),
    (
        "completion without an assistant turn",
        body(mode="trace", max_tokens=None, capture={"modules": ["model.layers.1"], "positions": "completion"}),
        422,
        "these messages do not end with one",
    ),
    (
        "completion on a raw prompt",
        body(
            mode="trace",
            max_tokens=None,
            messages=None,
            prompt="2 + 3 = 5",
            capture={"modules": ["model.layers.1"], "positions": "completion", "reduce": "mean"},
        ),
        422,
        "raw `prompt` text with no turns",
    ),
    (
        "completion on a generation job",
        body(capture={"modules": ["model.layers.1"], "positions": "completion"}),
        422,
        "a generation job's new tokens are positions 'generated'",
    ),
    (
        "bad reduction",
        body(capture={"modules": ["model.layers.1"], "reduce": "median"}),
        422,
        "capture.reduce: Input should be 'none', 'mean', 'sum', 'max' or 'last'",
    ),
    (
        "features past the width",
        body(capture={"modules": ["model.layers.1"], "features": "0:65"}),
        422,
        "module 'model.layers.1' (output width 64): features \"0:65\" ends past the width 64",
    ),
    (
        "feature index out of range",
        body(capture={"modules": ["model.layers.1"], "features": [3, 64]}),
        422,
        "feature indices [64] are out of range for the width 64 (0 to 63)",
    ),
    ("empty feature slice", body(capture={"modules": ["model.layers.1"], "features": "8:8"}), 422, "0 <= a < b"),
    ("repeated features", body(capture={"modules": ["model.layers.1"], "features": [1, 1]}), 422, "must not repeat"),
    (
        "extra capture field",
        body(capture={"modules": ["model.layers.1"], "layer": [1]}),
        422,
        "capture.layer: Extra inputs are not permitted",
    ),
    ("temperature too high", body(temperature=5), 422, "temperature: Input should be less than or equal to 2"),
    ("negative temperature", body(temperature=-1), 422, "temperature: Input should be greater than or equal to 0"),
    ("zero top_p", body(top_p=0), 422, "top_p: Input should be greater than 0"),
    ("negative seed", body(seed=-1), 422, "seed: Input should be greater than or equal to 0"),
    ("too many stop strings", body(stop=["a"] * 9), 422, "stop: List should have at most 8 items"),
    (
        "empty capture",
        body(capture={"modules": []}),
        422,
        "name what to capture: `modules` (path patterns) or a `preset`",
    ),
    ("prompt and messages", body(prompt="2+3="), 422, "give exactly one of `messages`"),
    ("neither prompt nor messages", body(messages=None), 422, "give exactly one of `messages`"),
    ("empty prompt", body(messages=None, prompt=""), 422, "prompt: String should have at least 1 character"),
    (
        "messages to a base model",
        body(model="tiny-base"),
        422,
        "model 'tiny-base' has no chat template, so `messages` cannot be rendered: send the text as `prompt`",
    ),
    (
        "prompt past the context",
        body(messages=None, prompt="x" * 30_000, capture=None),
        422,
        "your prompt contains at least 371 input tokens",
    ),
    (
        "unknown preset",
        body(capture={"preset": "heads"}),
        422,
        "model 'tiny' has no preset 'heads'; its presets: attention, mlp, residual",
    ),
    ("preset name not a name", body(capture={"preset": "Residual!"}), 422, "capture.preset: String should match"),
    (
        "preset layer out of range",
        body(capture={"preset": "residual", "layers": [1, 4]}),
        422,
        "layer 4 is out of range for preset 'residual': model 'tiny' has 4 layers (0 to 3, or -1 for the last)",
    ),
    (
        "preset layer below range",
        body(capture={"preset": "residual", "layers": [-5]}),
        422,
        "layer -5 is out of range",
    ),
    (
        "layers without a preset",
        body(capture={"modules": ["model.layers.1"], "layers": [1]}),
        422,
        "`layers` picks the blocks of a `preset`",
    ),
]


@pytest.mark.parametrize(("case", "payload", "status", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_refused_and_nothing_is_enqueued(http, redis_client, case, payload, status, message):
    jobs_before, queued_before = job_count(redis_client), queued_messages(redis_client, TINY)
    response = http.post("/jobs", json=payload)
    assert response.status_code == status, response.text
    error = response.json()
    assert message in error["detail"], error
    assert error["error"] and "Traceback" not in response.text
    assert job_count(redis_client) == jobs_before
    assert queued_messages(redis_client, TINY) == queued_before


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"model": "tiny", "messages": [', "the request body is not valid JSON"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "not valid JSON"),
        (b"\xff\xfe not utf-8", "not valid JSON"),
    ],
)
def test_malformed_json_is_a_400(http, redis_client, content, message):
    jobs_before = job_count(redis_client)
    response = http.post("/jobs", content=content, headers={"content-type": "application/json"})
    assert response.status_code in (400, 422), response.text
    assert message in response.json()["detail"] or response.status_code == 422
    assert job_count(redis_client) == jobs_before


@pytest.mark.parametrize(
    "job_id", ["nope", "../../etc/passwd", "00000000-0000-4000-8000-000000000000", "..%2f..%2fetc%2fpasswd", "%2e%2e"]
)
def test_unknown_or_malformed_job_ids_are_404(http, job_id):
    for path in (f"/jobs/{job_id}", f"/jobs/{job_id}/activations"):
        response = http.get(path)
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"] in ("job_not_found", "not_found")  # a normalised path may match no route


def test_an_empty_idempotency_key_is_refused(http, redis_client):
    response = http.post("/jobs", json=body(), headers={"Idempotency-Key": ""})
    assert response.status_code == 422 and "idempotency-key" in response.json()["detail"].lower()
    assert job_count(redis_client) == 0


def test_deleting_a_job_frees_its_idempotency_key(http, redis_client):
    """A deleted job's Idempotency-Key used to point at nothing: each retry with it held a
    threadpool thread for the 2 s wait for a record that would never come."""
    first = http.post("/jobs", json=body(), headers={"Idempotency-Key": "reused"}).json()["id"]
    assert http.delete(f"/jobs/{first}").json()["status"] == "cancelled"  # queued: no worker here
    assert http.delete(f"/jobs/{first}").status_code == 204  # finished: deleted
    assert list(redis_client.scan_iter(match="actq:idem:*")) == []
    started = time.monotonic()
    again = http.post("/jobs", json=body(), headers={"Idempotency-Key": "reused"})
    assert again.status_code == 202 and again.json()["id"] != first
    assert time.monotonic() - started < 1.0


def test_a_prompt_that_cannot_fit_is_refused_at_submit(http, redis_client):
    """25 messages of a million characters used to be accepted; the worker then tokenized 4.2 M
    tokens for 26 s. A prompt of B bytes is at least B / max_token_bytes tokens (81 bytes for
    SmolLM2's vocabulary), so the API refuses what cannot fit the context (256 here)."""
    response = http.post("/jobs", json=body(messages=[{"role": "user", "content": "x" * 30_000}], capture=None))
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error"] == "context_length_exceeded"
    assert "contains at least 371 input tokens" in error["detail"]
    assert error["detail"].startswith("This model's maximum context length is 256 tokens.")
    assert job_count(redis_client) == 0
    fits = http.post("/jobs", json=body(messages=[{"role": "user", "content": "x" * 2_000}], capture=None))
    assert fits.status_code == 202  # 25 tokens at least: the worker decides with the real count

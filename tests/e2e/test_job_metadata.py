"""Activations for clients that send no capture and read no extra field (lm-eval, LangChain), on the
live stack through the official `openai` client: the server's default capture (per model, per API
key), OpenAI's `metadata` and `user` stored with the job and listed by GET /jobs, and
`actq export --jobs` turning the picked jobs into one Parquet file in submission order."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import httpx
import pyarrow.parquet as pq
import pytest
from openai import OpenAI
from safetensors.torch import load

from shared.cli import export
from tests.support.stack import TINY, TestStack

ALPHA, BETA = "alpha-key-123", "beta-key-456"
MODEL_DEFAULT = {"modules": ["model.layers.1"], "positions": "all"}
ALPHA_DEFAULT = {"modules": ["model.layers.2"], "positions": "last"}


@pytest.fixture(scope="module")
def defaults_api(live, tmp_path_factory):
    """A second API on the session's Redis, store and worker, with keys and default captures."""
    env = {
        **live.env,
        "ACTQ_API_KEYS": f"{ALPHA},{BETA}",
        "ACTQ_DEFAULT_CAPTURE_BY_MODEL": json.dumps({TINY: MODEL_DEFAULT}),
        "ACTQ_DEFAULT_CAPTURE_BY_KEY": json.dumps({ALPHA: ALPHA_DEFAULT}),
    }
    with TestStack(tmp_path_factory.mktemp("defaults"), env) as stack:
        stack.start_api()
        yield stack.base_url


def openai_client(base: str, key: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key=key, timeout=120)


def http_client(base: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def stored_tensors(base: str, key: str, job_id: str) -> set[str]:
    """The tensor names in the job's activations file, as downloaded."""
    with http_client(base, key) as http:
        response = http.get(f"/jobs/{job_id}/activations", follow_redirects=True)
        assert response.status_code == 200, response.text
    return set(load(response.content)) - {"token_ids"}


def test_a_request_without_capture_gets_the_servers_default(defaults_api):
    with openai_client(defaults_api, BETA) as beta, openai_client(defaults_api, ALPHA) as alpha:
        raw = beta.completions.with_raw_response.create(model=TINY, prompt="The capital of France is", max_tokens=2)
        job_id = raw.headers["x-actq-job-id"]  # what a client that drops `actq` still sees
        assert raw.parse().model_extra["actq"]["job_id"] == job_id
        assert stored_tensors(defaults_api, BETA, job_id) == {"model.layers.1"}
        chat = beta.chat.completions.with_raw_response.create(
            model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert stored_tensors(defaults_api, BETA, chat.headers["x-actq-job-id"]) == {"model.layers.1"}
        scored = beta.completions.with_raw_response.create(
            model=TINY, prompt="2 + 2 = 4", max_tokens=0, echo=True, logprobs=1
        )  # what lm-eval's loglikelihood requests send: a trace job, captured too
        (info,) = scored.parse().model_extra["actq"]["activations"]["tensors"]
        assert info["name"] == "model.layers.1" and info["positions"] == "all"

        # the key's default wins over the model's; the request's own capture wins over both
        keyed = alpha.completions.with_raw_response.create(model=TINY, prompt="The capital of France is", max_tokens=2)
        assert stored_tensors(defaults_api, ALPHA, keyed.headers["x-actq-job-id"]) == {"model.layers.2"}
        own = alpha.completions.with_raw_response.create(
            model=TINY,
            prompt="The capital of France is",
            max_tokens=2,
            extra_body={"capture": {"modules": ["model.layers.0"], "positions": "prompt"}},
        )
        assert stored_tensors(defaults_api, ALPHA, own.headers["x-actq-job-id"]) == {"model.layers.0"}
    # POST /jobs callers send their own capture: no default there
    with http_client(defaults_api, BETA) as http:
        job = http.post("/jobs", json={"model": TINY, "prompt": "hi", "max_tokens": 2}).json()["id"]
        assert http.get(f"/jobs/{job}", params={"wait": 60}).json()["activations"] is None


def test_a_default_that_does_not_fit_is_a_400_naming_the_setting(live, tmp_path):
    env = {
        **live.env,
        "ACTQ_DEFAULT_CAPTURE_BY_MODEL": json.dumps({TINY: {"modules": ["model.layers.0"], "positions": "generated"}}),
    }
    with TestStack(tmp_path, env) as stack:
        stack.start_api()
        with OpenAI(base_url=stack.base_url + "/v1", api_key="unused", timeout=120) as client:
            with pytest.raises(Exception, match="ACTQ_DEFAULT_CAPTURE_BY_MODEL") as raised:
                client.completions.create(model=TINY, prompt="2 + 2 = 4", max_tokens=0, echo=True, logprobs=1)
            assert getattr(raised.value, "status_code", None) == 400
            fits = client.completions.create(model=TINY, prompt="2 + 2 =", max_tokens=2)
            assert [t["name"] for t in fits.model_extra["actq"]["activations"]["tensors"]] == ["model.layers.0"]


def test_metadata_and_user_are_stored_listed_and_exported(defaults_api, tmp_path):
    """An lm-eval-like run: generation requests tagged through the body (lm-eval's gen_kwargs),
    scoring requests that cannot be tagged; one Parquet file of either, in submission order."""
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(4)]
    start = datetime.now(UTC)
    with openai_client(defaults_api, BETA) as client:
        for i, prompt in enumerate(prompts):
            client.completions.create(
                model=TINY,
                prompt=prompt,
                max_tokens=2,
                user="harness",
                extra_body={"metadata": {"run": "e2e", "doc": str(i)}},
            )
        chat = client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=2,
            metadata={"run": "e2e", "doc": "chat"},
        )
        for prompt in prompts[:2]:  # untagged scoring requests
            client.completions.create(model=TINY, prompt=prompt + " 2", max_tokens=0, echo=True, logprobs=1)
    with http_client(defaults_api, BETA) as http:
        listed = http.get("/jobs", params={"metadata.run": "e2e"}).json()
        assert [j["metadata"]["doc"] for j in listed] == ["chat", "3", "2", "1", "0"]
        assert [j["user"] for j in listed] == [None, "harness", "harness", "harness", "harness"]
        assert listed[-1]["prompt_preview"] == prompts[0] and listed[0]["prompt_preview"] == "Name a colour."
        assert listed[0]["id"] == chat.model_extra["actq"]["job_id"]
        assert [j["id"] for j in http.get("/jobs", params={"metadata.run": "e2e", "user": "harness"}).json()] == [
            j["id"] for j in listed[1:]
        ]
        assert (
            http.get("/jobs", params={"metadata.doc": "2", "metadata.run": "e2e"}).json()[0]["prompt_preview"]
            == (prompts[2])
        )
    # another key sees none of them
    with http_client(defaults_api, ALPHA) as http:
        assert http.get("/jobs", params={"metadata.run": "e2e"}).json() == []

    out = export.run(None, out=tmp_path / "run.parquet", api=defaults_api, api_key=BETA, jobs=["metadata.run=e2e"])
    rows = pq.read_table(out).to_pylist()
    assert [r["metadata.doc"] for r in rows] == ["0", "1", "2", "3", "chat"]  # submission order
    assert [r["prompt"] for r in rows] == [*prompts, "Name a colour."]
    assert json.loads(rows[-1]["messages"]) == [{"role": "user", "content": "Name a colour."}]
    assert [r["job_id"] for r in rows] == [j["id"] for j in listed[::-1]]
    assert all(r["metadata.run"] == "e2e" and r["point"] == "model.layers.1" for r in rows)
    assert [r["user"] for r in rows] == ["harness"] * 4 + [None]
    times = [r["created_at"] for r in rows]
    assert times == sorted(times) and times[0] >= start
    for row in rows:  # positions "all": a row per token fed (the last generated one never is)
        assert len(row["activations"]) == row["shape"][0] == len(row["token_ids"]) - 1
        assert row["row_positions"] == list(range(row["shape"][0]))

    # the untagged scoring requests, picked by time instead, with every prompt whole
    scored = export.run(
        None,
        out=tmp_path / "scored.parquet",
        api=defaults_api,
        api_key=BETA,
        jobs=[f"created_after={start.isoformat()}"],
    )
    rows = pq.read_table(scored).to_pylist()
    assert [r["prompt"] for r in rows] == [*prompts, "Name a colour.", prompts[0] + " 2", prompts[1] + " 2"]
    assert "metadata.doc" in rows[0] and rows[-1]["metadata.doc"] is None and rows[-1]["user"] is None

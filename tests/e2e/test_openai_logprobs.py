"""Log-probabilities on the OpenAI-compatible routes, driven by the official `openai` client against
the live stack: chat `logprobs`/`top_logprobs`, the legacy completion's `logprobs` count, and
`echo: true` with `max_tokens: 0` (scoring a prompt). The values are checked against the job's own
(`GET /jobs/{id}`) and against an independent plain forward pass of the tiny model."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.reference import encode, reference_logprobs
from tests.support.stack import TINY, job_count, queued_messages

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The quick brown fox jumps over the lazy dog, and 12 + 30 = 42."


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """The served tiny model and its tokenizer, loaded here with plain transformers: the reference."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True, torch_dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


def job_of(completion) -> str:
    return completion.model_extra["actq"]["job_id"]


def whole_job(http, job_id: str) -> dict:
    """GET /jobs/{id} with its whole result: log-probabilities are kept apart from the job's record
    (GET /jobs/{id}/result) once the result passes ACTQ_RESULT_INLINE_BYTES."""
    job = http.get(f"/jobs/{job_id}").json()
    job["result"] = http.get(f"/jobs/{job_id}/result").json()
    return job


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward pass over `ids`: row i scores the token after position i."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_chat_logprobs_are_the_jobs_own_and_the_greedy_token_is_the_top_one(http, client, tiny):
    completion = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = completion.choices[0]
    job = whole_job(http, job_of(completion))
    assert job["status"] == "succeeded"
    expected = job["result"]["logprobs"]
    assert expected["in_file"] is False and len(expected["content"]) == completion.usage.completion_tokens == 8

    assert choice.logprobs is not None and choice.logprobs.refusal is None
    content = choice.logprobs.content
    assert len(content) == 8
    for entry, mine in zip(content, expected["content"], strict=True):
        assert entry.token == mine["token"] and entry.logprob == mine["logprob"]
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (t["token"], t["logprob"]) for t in mine["top_logprobs"]
        ]
        assert all(t.bytes == list(t.token.encode("utf-8")) for t in entry.top_logprobs)
        # greedy decoding: the chosen token is the likeliest one
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert entry.logprob == max(tops) and entry.token == entry.top_logprobs[0].token
    assert "".join(e.token for e in content) == choice.message.content  # 8 tokens, no stop, no EOS
    assert math.isclose(sum(e.logprob for e in content), expected["total"], rel_tol=1e-6, abs_tol=1e-5)

    # the values are those of a plain forward pass over the prompt and the generated tokens
    model, tokenizer = tiny
    prompt_ids = encode(tokenizer, MESSAGES)["input_ids"][0].tolist()
    assert len(prompt_ids) == completion.usage.prompt_tokens
    ids = torch.tensor(prompt_ids + [e["token_id"] for e in expected["content"]])
    with torch.inference_mode():
        logits = model(input_ids=ids[None]).logits[0]
    chosen, top_values, top_ids = reference_logprobs(logits, ids, len(prompt_ids), k=3)
    assert torch.allclose(torch.tensor([e.logprob for e in content]), chosen, atol=1e-4)
    assert torch.allclose(torch.tensor([[t.logprob for t in e.top_logprobs] for e in content]), top_values, atol=1e-4)
    assert [[t["token_id"] for t in e["top_logprobs"]] for e in expected["content"]] == top_ids.tolist()


def test_chat_logprobs_without_alternatives_and_not_asked(client):
    asked = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    content = asked.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob < 0 for e in content)
    zero = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=0
    )
    assert [(e.token, e.logprob) for e in zero.choices[0].logprobs.content] == [(e.token, e.logprob) for e in content]
    for off in ({}, {"logprobs": False}, {"logprobs": False, "top_logprobs": 0}):
        plain = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=4, temperature=0, **off)
        assert plain.choices[0].logprobs is None
        assert plain.choices[0].message.content == asked.choices[0].message.content


def test_sampled_chat_logprobs_are_from_the_raw_logits(http, client):
    """With temperature and top_p the values are still log_softmax of the raw logits: the same
    tokens score the same as under greedy decoding of the same text."""
    completion = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=6, temperature=1.5, top_p=0.9, seed=3, logprobs=True, top_logprobs=2
    )
    content = completion.choices[0].logprobs.content
    job = whole_job(http, job_of(completion))
    assert [e.logprob for e in content] == [e["logprob"] for e in job["result"]["logprobs"]["content"]]
    for entry in content:  # a sampled token's value is at most the likeliest one's
        assert entry.logprob <= entry.top_logprobs[0].logprob


def test_completion_logprobs_on_generated_text(http, client):
    completion = client.completions.create(
        model=TINY, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2
    )
    choice = completion.choices[0]
    job = whole_job(http, job_of(completion))
    expected = job["result"]["logprobs"]["content"]
    logprobs = choice.logprobs
    assert logprobs.tokens == [e["token"] for e in expected] and len(logprobs.tokens) == 6
    assert logprobs.token_logprobs == [e["logprob"] for e in expected]
    assert logprobs.top_logprobs == [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in expected]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value == max(top.values())  # greedy
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(6)]
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert choice.text[offset : offset + len(token)] == token

    zero = client.completions.create(model=TINY, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs is None
    assert zero.choices[0].logprobs.token_logprobs == logprobs.token_logprobs


def test_echo_with_max_tokens_0_scores_the_prompt_like_a_plain_forward_pass(http, client, tiny):
    completion = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = completion.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    model, tokenizer = tiny
    ids = tokenizer(PROMPT)["input_ids"]
    assert completion.usage.prompt_tokens == len(ids) and completion.usage.completion_tokens == 0
    job = whole_job(http, job_of(completion))
    assert job["status"] == "succeeded" and job["result"]["text"] == ""
    assert [e["token_id"] for e in job["result"]["logprobs"]["content"]] == ids

    logprobs = choice.logprobs
    n = len(ids)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(n)]
    assert all(PROMPT[o : o + len(t)] == t for t, o in zip(logprobs.tokens, logprobs.text_offset, strict=True))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None

    reference = forward_logprobs(model, ids)
    chosen = reference[torch.arange(n - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(logprobs.token_logprobs[1:]), chosen, atol=1e-5, rtol=0)
    top = torch.topk(reference, 2, dim=-1)
    for i in range(1, n):
        texts = tokenizer.batch_decode([[t] for t in top.indices[i - 1].tolist()])
        want = dict(zip(texts, top.values[i - 1].tolist(), strict=True))
        got = logprobs.top_logprobs[i]
        assert set(got) == set(want), (i, got, want)
        assert all(abs(got[t] - want[t]) <= 1e-5 for t in want), (i, got, want)
    total = job["result"]["logprobs"]["total"]
    assert math.isclose(sum(logprobs.token_logprobs[1:]), total, rel_tol=1e-6, abs_tol=1e-5)
    assert math.isclose(total, float(chosen.sum()), rel_tol=0, abs_tol=1e-4)


def test_echo_without_logprobs_and_with_ignored_sampling_fields(http, client):
    """echo + max_tokens 0 without logprobs: the prompt back, no logprobs; temperature, seed and stop
    (which evaluation harnesses send along) change nothing when nothing is sampled; a capture sees
    every prompt token."""
    completion = client.completions.create(
        model=TINY,
        prompt=PROMPT,
        max_tokens=0,
        echo=True,
        temperature=0,
        seed=1234,
        stop=["\n"],
        extra_body={"capture": {"modules": ["model.layers.1"]}},
    )
    choice = completion.choices[0]
    assert choice.text == PROMPT and choice.logprobs is None and choice.finish_reason == "length"
    (tensor,) = completion.model_extra["actq"]["activations"]["tensors"]
    assert tensor["shape"] == [completion.usage.prompt_tokens, 64]
    scored = client.completions.create(
        model=TINY, prompt=PROMPT, max_tokens=0, echo=True, temperature=0.7, seed=1, logprobs=0
    )
    plain = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert plain.choices[0].logprobs.top_logprobs is None


CHAT_REFUSED = [
    ("top_logprobs 21", dict(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs=21 is out of range"),
    ("top_logprobs -1", dict(logprobs=True, top_logprobs=-1), "top_logprobs", "from 0 to 20"),
    ("top_logprobs alone", dict(top_logprobs=3), "top_logprobs", "top_logprobs=3 needs logprobs=true"),
    ("logprobs false", dict(logprobs=False, top_logprobs=2), "top_logprobs", "top_logprobs=2 needs logprobs=true"),
]
COMPLETION_REFUSED = [
    ("logprobs 21", dict(logprobs=21), "logprobs", "logprobs=21 is out of range"),
    ("logprobs -1", dict(logprobs=-1), "logprobs", "logprobs=-1 is out of range"),
    ("max_tokens 0 alone", dict(max_tokens=0, logprobs=1), "max_tokens", "without echo=true there is nothing"),
]


@pytest.mark.parametrize(("case", "changes", "param", "message"), CHAT_REFUSED, ids=[r[0] for r in CHAT_REFUSED])
def test_chat_refused_with_the_field_named_and_nothing_queued(client, redis_client, case, changes, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=4, **changes)
    assert message in str(raised.value) and raised.value.param == param, str(raised.value)
    assert job_count(redis_client) == 0 and queued_messages(redis_client, TINY) == 0


@pytest.mark.parametrize(
    ("case", "changes", "param", "message"), COMPLETION_REFUSED, ids=[r[0] for r in COMPLETION_REFUSED]
)
def test_completion_refused_with_the_field_named_and_nothing_queued(
    client, redis_client, case, changes, param, message
):
    kwargs = {"model": TINY, "prompt": PROMPT, "max_tokens": 4, **changes}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**{k: v for k, v in kwargs.items() if v is not None})
    assert message in str(raised.value) and raised.value.param == param, str(raised.value)
    assert job_count(redis_client) == 0 and queued_messages(redis_client, TINY) == 0


INLINE = "tiny-lp-inline4"


@pytest.fixture(scope="module")
def inline_4(live, tiny_dir):
    """A worker of the tiny model that holds at most 4 log-probability entries inline."""
    env = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": INLINE, "ACTQ_LOGPROBS_INLINE_TOKENS": "4"}
    live.start_worker(INLINE, env)
    yield INLINE
    live.stop_process(f"worker-{INLINE}")


def test_more_logprobs_than_held_inline_is_a_400_naming_the_job_whose_file_has_them(http, client, inline_4):
    few = client.chat.completions.create(model=inline_4, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    assert len(few.choices[0].logprobs.content) == 4

    no_retries = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        no_retries.chat.completions.create(
            model=inline_4, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
        )
    error = raised.value
    assert isinstance(error.body, dict)
    job_id = error.body["job_id"]
    assert error.code == "logprobs_too_long" and error.param == "logprobs"
    assert error.response.headers["x-should-retry"] == "false"
    assert f"job {job_id} succeeded, but its 8 tokens of log-probabilities" in str(error)
    assert f"GET /jobs/{job_id}/activations" in str(error) and "ACTQ_LOGPROBS_INLINE_TOKENS" in str(error)
    job = http.get(f"/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["result"]["logprobs"]["in_file"] is True
    download = http.get(f"/jobs/{job_id}/activations")
    assert download.status_code == 200
    tensors = load_safetensors(download.content)
    assert tensors["logprobs"].shape == (8,) and tensors["top_logprobs"].shape == (8, 2)
    assert math.isclose(float(tensors["logprobs"].sum()), job["result"]["logprobs"]["total"], abs_tol=1e-4)
    # the first 4 are those of the 4-token reply above (the same greedy text)
    assert tensors["logprobs"][:4].tolist() == pytest.approx([e.logprob for e in few.choices[0].logprobs.content])

    with pytest.raises(openai.BadRequestError) as raised:  # a scored prompt of more than 4 tokens too
        no_retries.completions.create(model=inline_4, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert raised.value.code == "logprobs_too_long" and "tokens of log-probabilities" in str(raised.value)


def test_return_tokens_as_token_ids_names_each_token_by_its_id(client, tiny):
    """vLLM's `return_tokens_as_token_ids`: every token of the logprob entries, and every
    alternative, is `token_id:<id>`, the ids the tokenizer gives the reply (the same values)."""
    _, tokenizer = tiny
    chat = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    as_ids = client.chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    plain, named = chat.choices[0].logprobs.content, as_ids.choices[0].logprobs.content
    ids = [int(entry.token.removeprefix("token_id:")) for entry in named]
    assert all(entry.token.startswith("token_id:") for entry in named)
    assert [tokenizer.decode([i]) for i in ids] == [entry.token for entry in plain]
    assert [e.logprob for e in named] == [e.logprob for e in plain]
    for a, b in zip(plain, named, strict=True):
        assert [tokenizer.decode([int(t.token.removeprefix("token_id:"))]) for t in b.top_logprobs] == [
            t.token for t in a.top_logprobs
        ]
    legacy = client.completions.create(
        model=TINY,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = legacy.choices[0].logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens)
    assert tokenizer.decode([int(t.removeprefix("token_id:")) for t in tokens]) == legacy.choices[0].text
    assert all(key.startswith("token_id:") for top in legacy.choices[0].logprobs.top_logprobs for key in top)

"""Several prompts and choices per OpenAI request, token-id prompts, and echo with generation, driven
by the official `openai` client against the live stack: each prompt and each of its `n` choices is
its own job (its own id, capture and idempotency), and each equals the same request sent alone;
echoed log-probabilities equal an independent plain forward pass of the tiny model."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared import keys
from shared.schemas import JobRecord
from tests.support.stack import TINY, job_count

PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):"]
CAPTURE = {"modules": ["model.layers.1"], "positions": "all"}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


def request_of(redis_client, job_id: str):
    return JobRecord.model_validate_json(redis_client.get(keys.job(job_id))).request


def extra(completion) -> dict:
    return completion.model_extra["actq"]


def test_several_prompts_are_one_job_each_answered_in_order_as_if_sent_alone(live, client, http, redis_client):
    raw = client.completions.with_raw_response.create(
        model=TINY, prompt=PROMPTS, max_tokens=5, temperature=0, extra_body={"capture": CAPTURE}
    )
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    jobs = [c["job_id"] for c in extra(completion)["choices"]]
    assert len(set(jobs)) == 3 and raw.headers["x-actq-job-id"] == ",".join(jobs)
    assert extra(completion)["job_id"] == jobs[0] and completion.id == f"cmpl-{jobs[0]}"
    prompt_tokens = 0
    for prompt, choice, job_id, manifest in zip(
        PROMPTS, completion.choices, jobs, extra(completion)["choices"], strict=True
    ):
        alone = client.completions.create(model=TINY, prompt=prompt, max_tokens=5, temperature=0)
        assert choice.text == alone.choices[0].text and choice.finish_reason == alone.choices[0].finish_reason
        job = http.get(f"/jobs/{job_id}").json()
        assert request_of(redis_client, job_id).prompt == prompt and job["result"]["text"] == choice.text
        assert manifest["activations"]["tensors"][0]["name"] == "model.layers.1"  # each job its own capture
        prompt_tokens += alone.usage.prompt_tokens
    assert completion.usage.prompt_tokens == prompt_tokens and completion.usage.completion_tokens == 15


def test_n_choices_are_n_jobs_and_a_seeded_choice_draws_with_seed_plus_its_index(client, http):
    sampled = dict(model=TINY, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=40)
    completion = client.completions.create(n=3, **sampled)
    assert len(completion.choices) == 3 and len({c["job_id"] for c in extra(completion)["choices"]}) == 3
    for j, choice in enumerate(completion.choices):
        alone = client.completions.create(**{**sampled, "seed": 40 + j})
        assert choice.text == alone.choices[0].text
    assert completion.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counted once

    chat = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Count to five."}], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same text
    assert len({c["job_id"] for c in extra(chat)["choices"]}) == 2


def test_token_id_prompts_are_fed_as_given(client, redis_client, tiny):
    _, tokenizer = tiny
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    texts = client.completions.create(model=TINY, prompt=PROMPTS[:2], max_tokens=5, temperature=0)
    as_ids = client.completions.create(model=TINY, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in as_ids.choices] == [c.text for c in texts.choices]
    request = request_of(redis_client, extra(as_ids)["choices"][1]["job_id"])
    assert request.prompt_token_ids == ids[1] and request.prompt is None

    one = client.completions.create(model=TINY, prompt=ids[0][1:], max_tokens=3, temperature=0)  # nothing added
    assert one.usage.prompt_tokens == len(ids[0]) - 1


def test_echo_with_generation_scores_the_prompt_then_the_tokens_like_a_plain_forward_pass(client, http, tiny):
    """What lm-eval's loglikelihood requests send: echo, max_tokens 1, logprobs 1 (here with
    more tokens): the prompt's tokens and log-probabilities, then the generated ones', from one job."""
    model, tokenizer = tiny
    completion = client.completions.create(
        model=TINY, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    (choice,) = completion.choices
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    job = http.get(f"/jobs/{extra(completion)['job_id']}/result").json()
    generated = [entry["token_id"] for entry in job["logprobs"]["content"][len(prompt_ids) :]]
    assert len(generated) == 4 and job["logprobs"]["prompt_entries"] == len(prompt_ids)
    assert choice.text == PROMPTS[0] + job["text"]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None

    whole = torch.tensor([prompt_ids + generated])
    with torch.inference_mode():
        reference = torch.log_softmax(model(input_ids=whole).logits[0].float(), dim=-1)
    expected = [float(reference[i, whole[0, i + 1]]) for i in range(whole.shape[1] - 1)]
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:], expected, strict=True)) < 1e-4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])

    # the same numbers as scoring the prompt alone (echo, max_tokens 0) and as the plain generation
    scored = client.completions.create(model=TINY, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0)
    plain = client.completions.create(model=TINY, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=0)
    n = len(prompt_ids)
    assert (
        max(
            abs(a - b)
            for a, b in zip(logprobs.token_logprobs[1:n], scored.choices[0].logprobs.token_logprobs[1:], strict=True)
        )
        < 1e-5
    )
    assert (
        max(
            abs(a - b)
            for a, b in zip(logprobs.token_logprobs[n:], plain.choices[0].logprobs.token_logprobs, strict=True)
        )
        < 1e-5
    )
    assert choice.text == PROMPTS[0] + plain.choices[0].text

    # echo without logprobs: the prompt before the text; of token ids, their tokens' texts
    echoed = client.completions.create(model=TINY, prompt=[prompt_ids], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].logprobs is None
    assert echoed.choices[0].text.startswith(PROMPTS[0]) and echoed.choices[0].text != PROMPTS[0]


def reference_prompt_logprobs(model, ids: list[int], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs from a plain float32 forward pass: per prompt token after the first,
    token id -> (log-probability, rank), the token's own entry and the k likeliest."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    places: list[dict | None] = [None]
    for i in range(1, len(ids)):
        row = logprobs[i - 1]
        own = float(row[ids[i]])
        place = {ids[i]: (own, int((row >= row[ids[i]]).sum()))}
        top = torch.topk(row, k)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), start=1):
            place.setdefault(token, (value, rank))
        places.append(place)
    return places


def assert_prompt_logprobs_match(shown: list, expected: list[dict | None], tokenizer) -> None:
    assert len(shown) == len(expected) and shown[0] is None and expected[0] is None
    for got, want in zip(shown[1:], expected[1:], strict=True):
        assert set(got) == {str(t) for t in want}, (got, want)
        for token, (value, rank) in want.items():
            entry = got[str(token)]
            assert abs(entry["logprob"] - value) < 1e-4 and entry["rank"] == rank, (token, entry, value, rank)
            assert entry["decoded_token"] == tokenizer.decode([token])


def test_prompt_logprobs_follow_vllms_shape_and_a_plain_forward_pass(client, http, tiny):
    """vLLM's `prompt_logprobs: k` on both routes: per prompt token, its log-probability and rank
    (how many tokens were at least as likely) and the k likeliest, none for the first; beside the
    generated tokens' own `logprobs` count, each part with its own number of alternatives."""
    model, tokenizer = tiny
    prompt_ids = tokenizer(PROMPTS[1])["input_ids"]
    asked = {"model": TINY, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0}
    raw = http.post("/v1/completions", json={**asked, "prompt_logprobs": 3, "logprobs": 1}).json()
    (choice,) = raw["choices"]
    assert_prompt_logprobs_match(choice["prompt_logprobs"], reference_prompt_logprobs(model, prompt_ids, 3), tokenizer)
    plain = client.completions.create(**asked, logprobs=1).choices[0]
    assert choice["text"] == plain.text  # the prompt's scores change nothing generated, nor the generated logprobs
    assert choice["logprobs"]["tokens"] == plain.logprobs.tokens and len(choice["logprobs"]["tokens"]) == 3
    assert all(len(top) <= 1 for top in choice["logprobs"]["top_logprobs"])  # its own count, not the prompt's 3

    # only prompt_logprobs asked: no `logprobs`; k = 0: each token's own entry alone; a scoring job too
    only = http.post("/v1/completions", json={**asked, "prompt_logprobs": 0}).json()["choices"][0]
    assert only["logprobs"] is None
    assert_prompt_logprobs_match(only["prompt_logprobs"], reference_prompt_logprobs(model, prompt_ids, 0), tokenizer)
    scoring = {**asked, "max_tokens": 0, "echo": True, "prompt_logprobs": 2}
    scored = http.post("/v1/completions", json=scoring).json()["choices"][0]
    assert_prompt_logprobs_match(scored["prompt_logprobs"], reference_prompt_logprobs(model, prompt_ids, 2), tokenizer)
    assert scored["logprobs"] is None and scored["text"] == PROMPTS[1]

    # chat: at the top level, over the prompt the chat template renders
    messages = [{"role": "user", "content": "Count: one, two"}]
    chat = http.post(
        "/v1/chat/completions", json={"model": TINY, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    ).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    expected = reference_prompt_logprobs(model, list(rendered["input_ids"]), 1)
    assert_prompt_logprobs_match(chat["prompt_logprobs"], expected, tokenizer)
    assert chat["choices"][0]["logprobs"] is None


def test_prompt_logprobs_are_refused_where_they_cannot_be_served(http, redis_client):
    before = job_count(redis_client)
    bad = [
        ({"prompt_logprobs": 21}, "prompt_logprobs=21 is out of range"),
        ({"prompt_logprobs": -1}, "prompt_logprobs=-1 is out of range"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not streamed"),
    ]
    for fields, message in bad:
        response = http.post("/v1/completions", json={"model": TINY, "prompt": "a b", **fields})
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == "prompt_logprobs"
    assert job_count(redis_client) == before  # nothing queued


def test_an_idempotency_key_covers_every_job_of_the_request(live, redis_client):
    body = {"model": TINY, "prompt": PROMPTS[:2], "max_tokens": 2, "temperature": 0, "n": 2}
    headers = {"Idempotency-Key": "fanout-1"}
    with httpx.Client(base_url=live.base_url, timeout=120) as http:
        first = http.post("/v1/completions", json=body, headers=headers)
        again = http.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    ids = first.headers["x-actq-job-id"].split(",")
    assert len(ids) == 4 and again.headers["x-actq-job-id"].split(",") == ids
    assert job_count(redis_client) == 4


def test_langchains_legacy_llm_sends_several_prompts_in_one_request_and_gets_each_answer(live, client, redis_client):
    """LangChain's `OpenAI` LLM `generate` puts its prompts in one request (`"prompt": [...]`), and
    drops the `actq` field: each answer is still the prompt's own, and each prompt its own job."""
    from langchain_openai import OpenAI as LangChainLLM

    llm = LangChainLLM(
        base_url=live.base_url + "/v1", api_key="unused", model=TINY, max_tokens=5, temperature=0, max_retries=0
    )
    result = llm.generate(PROMPTS)
    assert job_count(redis_client) == len(PROMPTS)
    for prompt, generations in zip(PROMPTS, result.generations, strict=True):
        alone = client.completions.create(model=TINY, prompt=prompt, max_tokens=5, temperature=0)
        assert [g.text for g in generations] == [alone.choices[0].text]

"""`POST /v1/completions` (OpenAI's legacy completions: a raw text prompt, no chat template),
driven by the official `openai` client against the live stack."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime

import openai
import pytest
from transformers import AutoTokenizer

from shared import keys
from shared.schemas import JobRecord
from tests.support.stack import TINY, job_count

PROMPT = "The capital of France is"


def job_of(completion) -> str:
    return completion.model_extra["actq"]["job_id"]


def usage_of(completion) -> dict:
    return completion.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def test_plain_completion_is_a_raw_prompt_job(live, http, client, redis_client, tiny_dir):
    completion = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=6, temperature=0)
    job_id = job_of(completion)
    job = http.get(f"/jobs/{job_id}").json()
    assert job["status"] == "succeeded"
    assert completion.id == f"cmpl-{job_id}" and completion.object == "text_completion" and completion.model == TINY
    assert completion.created == int(datetime.fromisoformat(job["created_at"]).timestamp())
    (choice,) = completion.choices
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text == job["result"]["text"] and choice.text
    assert choice.finish_reason == job["result"]["finish_reason"] == "length"
    assert usage_of(completion) == job["result"]["usage"]
    assert completion.usage.completion_tokens == 6
    assert completion.model_extra["actq"]["activations"] is None

    # the job is the raw prompt, tokenized as it is: no chat template around it
    record = JobRecord.model_validate_json(redis_client.get(keys.job(job_id)))
    assert record.request.prompt == PROMPT and record.request.messages is None
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert completion.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    chat = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": PROMPT}], max_tokens=1, temperature=0
    )
    assert chat.usage.prompt_tokens > completion.usage.prompt_tokens  # the template's own tokens

    # the same as POST /jobs with that prompt
    posted = live.wait(http, live.submit(http, {"model": TINY, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}))
    assert posted["result"]["text"] == choice.text and posted["result"]["usage"] == job["result"]["usage"]


def test_response_body_is_openai_shaped(http):
    response = http.post("/v1/completions", json={"model": TINY, "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "actq"}
    assert body["object"] == "text_completion" and body["id"] == f"cmpl-{body['actq']['job_id']}"
    (choice,) = body["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_completion_with_capture_returns_the_manifest(http, client):
    completion = client.completions.create(
        model=TINY,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"capture": {"modules": ["model.layers.1"]}},
    )
    job = http.get(f"/jobs/{job_of(completion)}").json()
    manifest = completion.model_extra["actq"]["activations"]
    assert manifest == job["activations"]  # exactly as GET /jobs/{id} renders it
    (tensor,) = manifest["tensors"]
    rows = completion.usage.prompt_tokens + 4
    assert tensor["name"] == "model.layers.1" and tensor["shape"] == [rows, 64]
    download = http.get(manifest["download_url"])
    assert download.status_code == 200 and hashlib.sha256(download.content).hexdigest() == manifest["sha256"]


def test_seed_and_temperature_reproduce_the_text(client):
    def sampled(seed):
        return client.completions.create(
            model=TINY, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95, seed=seed
        ).choices[0]

    first, again, other = sampled(11), sampled(11), sampled(12)
    assert first.text == again.text != other.text


def test_stop_strings_cut_the_text(client):
    full = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    words = full.split()
    stop = words[len(words) // 2]
    for stops in (stop, [stop, "never-generated-zzz"]):
        cut = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=30, temperature=0, stop=stops).choices[0]
        assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]


def test_a_list_of_one_prompt_is_that_prompt(client):
    plain = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=4, temperature=0)
    listed = client.completions.create(model=TINY, prompt=[PROMPT], max_tokens=4, temperature=0)
    assert job_of(listed) != job_of(plain)
    assert listed.choices[0].text == plain.choices[0].text and usage_of(listed) == usage_of(plain)


REFUSED = [
    ("n 0", dict(n=0), "n", "n=0 is out of range"),
    ("n too many", dict(n=300), "n", "n=300 would make 300 jobs: one request makes at most 256"),
    (
        "stream_options without stream",
        dict(stream_options={"include_usage": True}),
        "stream_options",
        "stream_options is only allowed with stream=true",
    ),
    ("logprobs", dict(logprobs=25), "logprobs", "logprobs=25 is out of range"),
    ("suffix", dict(suffix=" and that is all."), "suffix", "suffix is not supported (no fill-in-the-middle)"),
    ("best_of", dict(best_of=3), "best_of", "best_of=3 is not supported"),
    ("frequency_penalty", dict(frequency_penalty=2.5), "frequency_penalty", "frequency_penalty: Input should be less"),
    ("presence_penalty", dict(presence_penalty=-3), "presence_penalty", "presence_penalty: Input should be greater"),
    ("logit_bias", dict(logit_bias={"1000000": -100}), None, "logit_bias names tokens outside the model's vocabulary"),
    ("logit_bias value", dict(logit_bias={"5": 101}), "logit_bias.5", "logit_bias.5: Input should be less than"),
    ("empty prompt", dict(prompt=""), "prompt", "prompt[0] is empty: send the text to complete"),
    ("empty list", dict(prompt=[]), "prompt", "prompt must be the text to complete (a non-empty string)"),
    ("one empty of two", dict(prompt=["one", ""]), "prompt", "prompt[1] is empty"),
    ("empty token ids", dict(prompt=[[1, 2], []]), "prompt", "prompt[1] is an empty list of token ids"),
    ("negative token id", dict(prompt=[1, -2]), "prompt", "prompt[1]=-2 is not a token id"),
    ("mixed shapes", dict(prompt=["one", 5]), "prompt", "prompt[1] must be a string or a list of token ids"),
    ("token id past the vocabulary", dict(prompt=[[1, 2], [3, 10**6]]), None, "choice[1]: token ids must be below"),
    ("prompts x n", dict(prompt=["a"] * 100, n=3), "n", "100 prompts x n=3 would make 300 jobs"),
    (
        "chat field",
        dict(extra_body={"messages": [{"role": "user", "content": "hi"}]}),
        "messages",
        "unknown field 'messages': /v1/completions takes OpenAI's completion fields",
    ),
    ("temperature", dict(temperature=5), "temperature", "temperature: Input should be less than or equal to 2"),
    (
        "bad capture",
        dict(extra_body={"capture": {"modules": ["model.layyers.1"]}}),
        "capture",
        "closest valid names: model.layers.1",
    ),
]


@pytest.mark.parametrize(("case", "changes", "param", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_the_field_named_and_nothing_queued(client, redis_client, case, changes, param, message):
    kwargs = {"model": TINY, "prompt": PROMPT, "max_tokens": 4, **changes}
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**kwargs)
    assert message in str(raised.value), str(raised.value)  # the client puts our message in the exception
    assert raised.value.param == param
    assert job_count(redis_client) == 0


def test_unknown_model_is_a_404_naming_model(client, redis_client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt=PROMPT, max_tokens=2)
    assert raised.value.param == "model" and "is not served here" in str(raised.value)
    assert job_count(redis_client) == 0


def test_a_job_not_done_in_time_is_a_504_naming_it_and_the_key_waits_for_the_same_job(client, http, redis_client):
    """A model no live worker serves: its job stays queued past actq_wait_seconds."""
    from shared.registry import ModelRegistry
    from shared.schemas import ModelInfo

    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    registry.publish(ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": "tiny-cmpl-offline"}))
    no_retries = client.with_options(max_retries=0)
    ids = []
    for _ in range(2):
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as raised:
            no_retries.completions.create(
                model="tiny-cmpl-offline",
                prompt=PROMPT,
                max_tokens=2,
                extra_body={"actq_wait_seconds": 0.5},
                extra_headers={"Idempotency-Key": "cmpl-504"},
            )
        assert time.monotonic() - started < 5
        error = raised.value
        assert error.status_code == 504 and error.code == "wait_timeout"
        assert f"job {error.body['job_id']} has not finished after 0.5 s (it is queued)" in str(error)
        ids.append(error.body["job_id"])
    assert ids[0] == ids[1] and job_count(redis_client) == 1
    assert http.get(f"/jobs/{ids[0]}").json()["status"] == "queued"

    # without a key the client must not retry into a second job
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(
            model="tiny-cmpl-offline", prompt=PROMPT, max_tokens=2, extra_body={"actq_wait_seconds": 0.5}
        )
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert job_count(redis_client) == 2

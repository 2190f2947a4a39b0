"""The OpenAI-compatible endpoints, driven by the official `openai` client against the live stack."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime

import openai
import pytest
from safetensors.torch import load as load_safetensors

from shared.calculator import TOOL
from tests.support.stack import TINY, job_count

MESSAGES = [{"role": "user", "content": "Name three colours."}]
WITH_SYSTEM = [{"role": "system", "content": "You are a terse assistant."}, *MESSAGES]


def job_of(completion) -> str:
    return completion.model_extra["actq"]["job_id"]


def test_completion_with_capture_is_the_job_and_its_activations(live, http, client):
    completion = client.chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"capture": {"modules": ["model.layers.1"]}},
    )
    job_id = job_of(completion)
    job = http.get(f"/jobs/{job_id}").json()
    assert job["status"] == "succeeded"
    assert completion.id == f"chatcmpl-{job_id}" and completion.object == "chat.completion" and completion.model == TINY
    assert completion.created == int(datetime.fromisoformat(job["created_at"]).timestamp())
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
    assert choice.message.content == job["result"]["text"]
    assert choice.finish_reason == job["result"]["finish_reason"] == "length"
    usage = completion.usage
    assert usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == job["result"]["usage"]
    assert usage.completion_tokens == 8 and usage.total_tokens == usage.prompt_tokens + 8

    manifest = completion.model_extra["actq"]["activations"]
    assert manifest == job["activations"]  # exactly as GET /jobs/{id} renders it
    (tensor,) = manifest["tensors"]
    rows = usage.prompt_tokens + 7
    assert (
        tensor["name"] == "model.layers.1"
        and tensor["shape"] == [rows, 64]
        and (tensor["start"], tensor["stop"]) == (0, rows)
    )
    download = http.get(manifest["download_url"])
    assert download.status_code == 200 and hashlib.sha256(download.content).hexdigest() == manifest["sha256"]
    tensors = load_safetensors(download.content)
    assert list(tensors["model.layers.1"].shape) == [rows, 64]
    assert tensors["token_ids"].shape[0] == usage.total_tokens


def test_plain_greedy_completion_equals_a_posted_job(live, http, client):
    completion = client.chat.completions.create(
        model=TINY, messages=WITH_SYSTEM, max_completion_tokens=12, temperature=0
    )
    assert completion.model_extra["actq"]["activations"] is None
    job = live.wait(
        http, live.submit(http, {"model": TINY, "messages": WITH_SYSTEM, "max_tokens": 12, "temperature": 0})
    )
    assert job_of(completion) != job["id"]
    assert completion.choices[0].message.content == job["result"]["text"]
    assert (
        completion.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
        == job["result"]["usage"]
    )


def test_text_parts_and_developer_role_are_plain_messages(client):
    plain = client.chat.completions.create(model=TINY, messages=WITH_SYSTEM, max_tokens=10, temperature=0)
    parts = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "You are a terse "}, {"type": "text", "text": "assistant."}],
        },
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]},
    ]
    joined = client.chat.completions.create(model=TINY, messages=parts, max_tokens=10, temperature=0)
    assert joined.choices[0].message.content == plain.choices[0].message.content
    assert joined.usage.prompt_tokens == plain.usage.prompt_tokens


def test_stop_string_and_seed(client):
    full = (
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=30, temperature=0)
        .choices[0]
        .message.content
    )
    stop = full.split()[len(full.split()) // 2]
    cut = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=30, temperature=0, stop=stop
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.find(stop)]

    def sampled(seed):
        return client.chat.completions.create(
            model=TINY, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.95, seed=seed
        )

    assert (
        sampled(11).choices[0].message.content
        == sampled(11).choices[0].message.content
        != sampled(12).choices[0].message.content
    )


def test_models(client):
    assert TINY in [m.id for m in client.models.list()]
    model = client.models.retrieve(TINY)
    assert model.id == TINY and model.object == "model" and model.owned_by == "actq"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
REFUSED = [
    (
        "stream_options without stream",
        dict(stream_options={"include_usage": True}),
        openai.BadRequestError,
        "stream_options",
        "stream_options is only allowed with stream=true",
    ),
    ("n 0", dict(n=0), openai.BadRequestError, "n", "n=0 is out of range"),
    ("n 257", dict(n=257), openai.BadRequestError, "n", "n=257 would make 257 jobs: one request makes at most 256"),
    (
        "malformed tool schema",
        dict(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]
        ),
        openai.BadRequestError,
        "tools[0].function.parameters",
        "tools[0].function.parameters['properties'] is not a valid JSON Schema",
    ),
    (
        "tool_choice without tools",
        dict(tool_choice="required"),
        openai.BadRequestError,
        "tool_choice",
        "tool_choice: Value error, tool_choice 'required' needs `tools`",
    ),
    (
        "unknown tool_choice function",
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        openai.BadRequestError,
        "tool_choice",
        "tool_choice names function 'get_time', which is not among the tools (get_weather)",
    ),
    (
        "top_logprobs without logprobs",
        dict(top_logprobs=2),
        openai.BadRequestError,
        "top_logprobs",
        "top_logprobs=2 needs logprobs=true",
    ),
    (
        "response_format without its schema",
        dict(response_format={"type": "json_schema"}),
        openai.BadRequestError,
        "response_format",
        "response_format of type 'json_schema' needs `json_schema`",
    ),
    (
        "penalty",
        dict(presence_penalty=5),
        openai.BadRequestError,
        "presence_penalty",
        "presence_penalty: Input should be less than or equal to 2",
    ),
    (
        "unknown field",
        dict(extra_body={"frobnicate": 1}),
        openai.BadRequestError,
        "frobnicate",
        "unknown field 'frobnicate'",
    ),
    (
        "unknown model",
        dict(model="gpt-17"),
        openai.NotFoundError,
        "model",
        "model 'gpt-17' is not served here; served models:",
    ),
    (
        "image part",
        dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        openai.BadRequestError,
        "messages[0].content[0]",
        "content parts of type 'image_url' are not supported",
    ),
    (
        "tool message answering no call",
        dict(messages=[*MESSAGES, {"role": "tool", "content": "42", "tool_call_id": "c1"}]),
        openai.BadRequestError,
        "messages",
        "messages: Value error, messages[1] answers tool call 'c1', which no earlier assistant message made",
    ),
    (
        "deprecated function role",
        dict(messages=[*MESSAGES, {"role": "function", "content": "42", "name": "f"}]),
        openai.BadRequestError,
        "messages[1].role",
        "role 'function' (the deprecated function calling) is not supported",
    ),
    (
        "both token limits",
        dict(max_tokens=4, max_completion_tokens=5),
        openai.BadRequestError,
        "max_completion_tokens",
        "differ",
    ),
    ("over the limit", dict(max_tokens=201), openai.BadRequestError, None, "max_tokens 201 exceeds the limit of 200"),
    (
        "temperature",
        dict(temperature=5),
        openai.BadRequestError,
        "temperature",
        "temperature: Input should be less than or equal to 2",
    ),
    (
        "bad capture",
        dict(extra_body={"capture": {"modules": ["model.layyers.1"]}}),
        openai.BadRequestError,
        "capture",
        "closest valid names: model.layers.1",
    ),
    (
        "capture typo",
        dict(extra_body={"capture": {"modules": ["model.layers.1"], "layer": [1]}}),
        openai.BadRequestError,
        "capture.layer",
        "unknown field 'capture.layer'",
    ),
    (
        "wait too long",
        dict(extra_body={"actq_wait_seconds": 4000}),
        openai.BadRequestError,
        "actq_wait_seconds",
        "less than or equal to 3600",
    ),
]


@pytest.mark.parametrize(("case", "changes", "error", "param", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_with_a_clear_error_and_nothing_enqueued(client, redis_client, case, changes, error, param, message):
    before = job_count(redis_client)
    kwargs = {"model": TINY, "messages": MESSAGES, "max_tokens": 4, **changes}
    with pytest.raises(error) as raised:
        client.chat.completions.create(**kwargs)
    assert message in str(raised.value), str(raised.value)  # the client puts our message in the exception
    assert raised.value.param == param
    assert job_count(redis_client) == before


def test_error_body_is_openai_shaped_and_has_detail(http):
    response = http.post("/v1/chat/completions", json={"model": TINY, "messages": MESSAGES, "service_tier": "flex"})
    assert response.status_code == 400
    body = response.json()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "unsupported_parameter"
    assert body["error"]["message"] == body["detail"]
    assert body["detail"].startswith("service_tier='flex' is not supported")
    bad_json = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"


LONG = [{"role": "user", "content": "word " * 400}]  # past the tiny model's 256-token context, though not by its bytes


def test_a_text_past_the_context_is_refused_in_openais_words_before_anything_is_queued(
    http, client, redis_client, tiny_dir
):
    """A text prompt over the context used to be queued and fail in the worker: an error about a
    job, not the bad request clients (litellm's ContextWindowExceededError) recognise by OpenAI's
    and vLLM's words. Its tokens are counted first, as the worker will count them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    chat_tokens = len(tokenizer.apply_chat_template(LONG, add_generation_prompt=True, return_dict=True)["input_ids"])
    text_tokens = len(tokenizer("word " * 400).input_ids)
    assert chat_tokens > 256 and text_tokens > 256 and len(("word " * 400).encode()) // 81 < 256  # by count only
    before = job_count(redis_client)
    calls = {
        "chat": lambda: client.chat.completions.create(model=TINY, messages=LONG, max_tokens=4),
        "stream": lambda: client.chat.completions.create(model=TINY, messages=LONG, max_tokens=4, stream=True),
        "completion": lambda: client.completions.create(model=TINY, prompt="word " * 400, max_tokens=4),
    }
    for name, call in calls.items():
        with pytest.raises(openai.BadRequestError) as raised:
            call()
        error = raised.value
        tokens, what = (text_tokens, "prompt") if name == "completion" else (chat_tokens, "messages")
        assert error.code == "context_length_exceeded", name
        assert error.body["message"] == (
            f"This model's maximum context length is 256 tokens. However, you requested {tokens + 4} tokens "
            f"({tokens} in the {what}, 4 in the completion). Please reduce the length of the {what} or completion."
        ), name
        assert "job_id" not in error.body
    assert job_count(redis_client) == before  # nothing queued
    fits = client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "word " * 100}], max_tokens=4
    )
    assert fits.choices[0].finish_reason == "length"  # a long text that fits is counted, then queued


def test_a_failed_job_is_an_error_naming_the_job(http, client, redis_client):
    """The count before queueing leaves out the tools a chat template renders: a text that fits
    alone and overflows with the calculator's tools in the prompt fails in the worker, which counts
    every token, and the error names the job."""
    messages = [{"role": "user", "content": "word " * 150}]
    before = job_count(redis_client)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=TINY, messages=messages, max_tokens=4, tools=[TOOL])
    error = raised.value
    assert error.code == "context_length_exceeded"
    assert "This model's maximum context length is 256 tokens" in str(error)
    assert error.response.headers["x-should-retry"] == "false"
    job = http.get(f"/jobs/{error.body['job_id']}").json()
    assert job["status"] == "failed" and job["error"]["type"] == "context_length_exceeded"
    assert job_count(redis_client) == before + 1


def test_a_job_not_done_in_time_is_a_504_naming_it_and_not_resubmitted(live, http, client, redis_client):
    """A model no live worker serves: its job stays queued past actq_wait_seconds."""
    from shared.registry import ModelRegistry
    from shared.schemas import ModelInfo

    registry = ModelRegistry(redis_client, heartbeat_ttl=4)
    registry.publish(ModelInfo.model_validate({**registry.get(TINY).model_dump(), "name": "tiny-openai-offline"}))
    assert "tiny-openai-offline" not in [m.id for m in client.models.list()]
    before = job_count(redis_client)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:  # the client's class for every 5xx
        client.chat.completions.create(
            model="tiny-openai-offline", messages=MESSAGES, max_tokens=4, extra_body={"actq_wait_seconds": 1}
        )
    error = raised.value
    assert error.status_code == 504 and error.code == "wait_timeout"
    assert error.response.headers["x-should-retry"] == "false"
    job_id = error.body["job_id"]
    assert f"job {job_id} has not finished after 1 s (it is queued)" in str(error) and f"GET /jobs/{job_id}" in str(
        error
    )
    assert 1 <= time.monotonic() - started < 5
    assert job_count(redis_client) == before + 1  # the client did not retry into a second job
    assert http.get(f"/jobs/{job_id}").json()["status"] == "queued"

    # With an Idempotency-Key, asking again waits for the same job instead of queueing another.
    no_retries = client.with_options(max_retries=0)
    ids = []
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as raised:
            no_retries.chat.completions.create(
                model="tiny-openai-offline",
                messages=MESSAGES,
                max_tokens=4,
                extra_body={"actq_wait_seconds": 0.5},
                extra_headers={"Idempotency-Key": "openai-504"},
            )
        ids.append(raised.value.body["job_id"])
    assert ids[0] == ids[1] and job_count(redis_client) == before + 2


def test_idempotency_key_gives_the_same_job_and_refuses_another_request(client):
    def create(max_tokens):
        return client.chat.completions.create(
            model=TINY,
            messages=MESSAGES,
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"Idempotency-Key": "openai-same"},
        )

    first, second = create(3), create(3)
    assert job_of(first) == job_of(second) and first.choices[0].message.content == second.choices[0].message.content
    with pytest.raises(openai.APIStatusError) as raised:
        create(4)
    assert raised.value.status_code in (400, 409) and "used for a different request" in str(raised.value)
    # 409 once submit raises Conflict for a reused key; the client must not retry it by itself
    assert raised.value.status_code == 400 or raised.value.response.headers["x-should-retry"] == "false"


def test_a_run_label_in_the_url_tags_every_job_of_the_run(live, http):
    """`/runs/<label>/v1` is the OpenAI API with each job tagged metadata.run=<label> (for clients
    that cannot tag their requests, lm-eval: tests/e2e/test_lm_eval.py), its tokenizer routes beside it."""
    from openai import OpenAI

    with OpenAI(base_url=f"{live.base_url}/runs/probe-7.a_b/v1", api_key="unused", max_retries=0) as labelled:
        chat = labelled.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2, n=2)
        text = labelled.completions.create(
            model=TINY, prompt="Hello", max_tokens=2, extra_body={"metadata": {"run": "probe-7.a_b"}}
        )
        streamed = [
            chunk.id
            for chunk in labelled.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2, stream=True)
            if chunk.choices
        ]
        with pytest.raises(openai.BadRequestError) as other_run:
            labelled.completions.create(
                model=TINY, prompt="Hello", max_tokens=2, extra_body={"metadata": {"run": "another"}}
            )
        assert other_run.value.code == "invalid_request" and "differs from the run label" in str(other_run.value)
    ids = [c["job_id"] for c in chat.model_extra["actq"]["choices"]] + [text.model_extra["actq"]["job_id"]]
    ids.append(streamed[0].removeprefix("chatcmpl-"))  # a stream's chunks carry its job's id
    listed = http.get("/jobs", params={"metadata.run": "probe-7.a_b", "limit": 100}).json()
    assert set(ids) == {job["id"] for job in listed} and len(ids) == 4  # both choices, the text, the stream
    assert all(job["metadata"] == {"run": "probe-7.a_b"} for job in listed)
    plain = http.post("/v1/completions", json={"model": TINY, "prompt": "Hello", "max_tokens": 2}).json()
    unlabelled = http.get("/jobs", params={"metadata.run": "probe-7.a_b", "limit": 100}).json()
    assert plain["actq"]["job_id"] not in {job["id"] for job in unlabelled}  # no label outside /runs/
    bad = http.post("/runs/-x/v1/completions", json={"model": TINY, "prompt": "Hello", "max_tokens": 2})
    assert bad.status_code == 400 and "is not a label" in bad.json()["error"]["message"]
    tokens = http.post("/runs/probe-7.a_b/tokenize", json={"model": TINY, "prompt": "Hello"})
    assert (
        tokens.status_code == 200
        and tokens.json() == http.post("/tokenize", json={"model": TINY, "prompt": "Hello"}).json()
    )


def test_an_assistant_prefill_is_continued_in_its_own_turn(http, client, tiny_dir):
    """vLLM's `continue_final_message` (with add_generation_prompt false): the reply goes on from
    the final assistant message's text; the job was given exactly the tokens the tokenizer's own
    apply_chat_template renders for it (read back from the activations file)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [*MESSAGES, {"role": "assistant", "content": "Red, green and"}]
    expected = tokenizer.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, return_dict=True
    )["input_ids"]
    reply = client.chat.completions.create(
        model=TINY,
        messages=messages,
        max_tokens=3,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "capture": {"modules": ["model.layers.1"]},
        },
    )
    assert reply.usage.prompt_tokens == len(expected)
    tensors = load_safetensors(http.get(reply.model_extra["actq"]["activations"]["download_url"]).content)
    assert tensors["token_ids"][: len(expected)].tolist() == list(expected)
    # a final user message is continued too, as transformers continues it (vLLM passes it through)
    user_final = tokenizer.apply_chat_template(
        MESSAGES, continue_final_message=True, add_generation_prompt=False, return_dict=True
    )["input_ids"]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    continued = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=3, extra_body=extra)
    assert continued.usage.prompt_tokens == len(user_final) != len(expected)


def test_penalties_bias_and_vllms_sampling_extras_reach_the_job(http, client):
    """The SDK's `logit_bias` and penalties, and vLLM's extras in `extra_body`, become the job's
    own settings (worker/model/sampling.py applies them: tests/worker/test_engine.py checks the tokens
    against transformers' processors): a banned first token is not the reply's first token, and a
    sampled reply with top_k 1 is the greedy one."""
    greedy = client.completions.create(model=TINY, prompt="Hello there", max_tokens=6, temperature=0, logprobs=0)
    first = greedy.choices[0].logprobs.tokens[0]
    first_id = http.post("/tokenize", json={"model": TINY, "prompt": first, "add_special_tokens": False}).json()
    banned = client.completions.create(
        model=TINY,
        prompt="Hello there",
        max_tokens=6,
        temperature=0,
        logprobs=0,
        logit_bias={str(first_id["tokens"][0]): -100},
        presence_penalty=0.5,
        frequency_penalty=0.25,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 6},
    )
    assert banned.choices[0].logprobs.tokens[0] != first
    stored = http.get(f"/jobs/{banned.model_extra['actq']['job_id']}/request").json()
    assert stored["logit_bias"] == {str(first_id["tokens"][0]): -100.0} and stored["repetition_penalty"] == 1.2
    assert (stored["presence_penalty"], stored["frequency_penalty"], stored["min_tokens"]) == (0.5, 0.25, 6)
    top1 = client.completions.create(
        model=TINY, prompt="Hello there", max_tokens=6, temperature=1.5, seed=5, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == greedy.choices[0].text

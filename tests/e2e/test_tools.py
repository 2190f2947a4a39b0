"""Tool calls through the whole stack, with a model that calls the calculator for real (the tiny
model trained at test time, tests/support/tool_model.py, its template Hermes 2 Pro's) and the
official `openai` client. Every reply is checked against plain transformers: the same
conversation rendered by the tokenizer's own `apply_chat_template(..., tools=...)`, greedy
`generate`, and the call read from its text with a regular expression and `json.loads` (not
with actq's parser)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch
from openai import OpenAI
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.calculator import TOOL, TOOL_NAME, calculate
from tests.e2e.conftest import TOOL_MODEL
from tests.support.stack import TINY, job_count
from tests.support.tool_model import POOL, problems

pytestmark = pytest.mark.model

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@pytest.fixture(scope="module")
def client(live_tools):
    with OpenAI(base_url=live_tools.base_url + "/v1", api_key="unused", timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tool_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir, local_files_only=True).eval()

    def generate(messages: list[dict], max_new_tokens: int) -> tuple[list[int], str]:
        inputs = tokenizer.apply_chat_template(
            messages, tools=[TOOL], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        return prompt, tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)

    return generate


@pytest.fixture(scope="module")
def held_out():
    seen = {p.question for p in problems(POOL, seed=0)}
    return [p for p in problems(40, seed=777) if p.question not in seen][:3]


def test_a_call_then_its_result_then_the_answer_equal_transformers(client, http, reference, held_out):
    for problem in held_out:
        question = [{"role": "user", "content": problem.question}]
        first = client.chat.completions.create(
            model=TOOL_MODEL, messages=question, tools=[TOOL], max_tokens=48, temperature=0
        )
        prompt, expected = reference(question, 48)
        job = http.get(f"/jobs/{first.model_extra['actq']['job_id']}").json()
        assert job["result"]["text"] == expected  # the raw text, kept for audit
        assert job["result"]["usage"]["prompt_tokens"] == len(prompt)
        written = [json.loads(m) for m in CALL.findall(expected)]
        assert len(written) == 1, expected  # the trained model makes one call
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (made,) = choice.message.tool_calls
        assert made.type == "function" and made.id.startswith("call_") and len(made.id) == 29
        assert made.function.name == written[0]["name"] == TOOL_NAME
        assert json.loads(made.function.arguments) == written[0]["arguments"]
        assert choice.message.content is None  # nothing but the call

        result = calculate(json.loads(made.function.arguments)["expression"]).text
        turns = [
            *question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": made.id, "content": result},
        ]
        second = client.chat.completions.create(model=TOOL_MODEL, messages=turns, tools=[TOOL], max_tokens=16)
        # the reference renders the same conversation as the template expects it: arguments as an
        # object, the result with the function's name
        _, answer = reference(
            [
                *question,
                {"role": "assistant", "tool_calls": [{"type": "function", "function": written[0]}]},
                {"role": "tool", "name": TOOL_NAME, "content": result},
            ],
            16,
        )
        assert second.choices[0].finish_reason == "stop"
        assert second.choices[0].message.tool_calls is None
        assert second.choices[0].message.content == answer
        assert answer == f"The answer is {problem.answer}."


def test_tool_choice_none_answers_the_text_as_it_is(client, reference, held_out):
    question = [{"role": "user", "content": held_out[0].question}]
    reply = client.chat.completions.create(
        model=TOOL_MODEL, messages=question, tools=[TOOL], tool_choice="none", max_tokens=48
    )
    _, expected = reference(question, 48)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == expected and "<tool_call>" in expected
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_calls_come_whole_in_one_delta(client, held_out):
    question = [{"role": "user", "content": held_out[1].question}]
    whole = client.chat.completions.create(model=TOOL_MODEL, messages=question, tools=[TOOL], max_tokens=48)
    chunks = list(
        client.chat.completions.create(model=TOOL_MODEL, messages=question, tools=[TOOL], max_tokens=48, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.function.name for c in calls] == [c.function.name for c in whole.choices[0].message.tool_calls]
    assert [c.function.arguments for c in calls] == [c.function.arguments for c in whole.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" if chunks[-1].choices else True
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_tool_choice_always_calls_it_with_arguments_that_fit(client):
    # not a word problem: the model is made to call the calculator, and the call fits its schema
    # (an expression of at most 12 characters, so that it ends well within max_tokens)
    short = json.loads(json.dumps(TOOL))
    short["function"]["parameters"]["properties"]["expression"]["maxLength"] = 12
    reply = client.chat.completions.create(
        model=TOOL_MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[short],
        tool_choice={"type": "function", "function": {"name": TOOL_NAME}},
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (made,) = choice.message.tool_calls
    arguments = json.loads(made.function.arguments)
    jsonschema.validate(arguments, short["function"]["parameters"])


def test_models_say_how_they_take_tools(http):
    models = {m["name"]: m for m in http.get("/models").json()}
    assert models[TOOL_MODEL]["tool_format"] == "hermes" and models[TOOL_MODEL]["tool_template"] is True
    # the tiny model's template (SmolLM2's) has no tools: actq's fallback prompt renders them
    assert models[TINY]["tool_format"] == "hermes" and models[TINY]["tool_template"] is False


LAST = {"preset": "residual", "layers": [0], "positions": "last"}  # a capture: its file holds the token ids
# the tiny model's context is 256 tokens: a tool with a short definition
SHORT = {
    "type": "function",
    "function": {"name": TOOL_NAME, "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
}


def test_a_template_without_tools_gets_them_in_the_fallback_prompt(live, http, smol_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": '{"expression": "2 + 3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    response = http.post(
        "/jobs",
        json={"model": TINY, "mode": "trace", "messages": messages, "tools": [SHORT], "capture": LAST},
    )
    assert response.status_code == 202, response.text
    job = live.wait(http, response.json()["id"])
    assert job["status"] == "succeeded", job
    ids = load_safetensors(http.get(job["activations"]["download_url"]).content)["token_ids"].tolist()
    text = tokenizer.decode(ids)
    tools_json = json.dumps(SHORT)
    # the tools in the system turn, the call in the assistant's, the result as a user turn
    assert "<|im_start|>system\n" in text and f"<tools>\n{tools_json}\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


BAD = [
    (
        "a tool message for a call never made",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zz", "content": "1"}]},
        "answers tool call 'zz', which no earlier assistant message made",
    ),
    (
        "a call id used twice",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    ],
                },
            ]
        },
        "tool call id 'a' is used twice",
    ),
    (
        "arguments that are not a JSON object",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                },
            ]
        },
        "arguments must be a JSON object written as a string, not list",
    ),
    (
        "two tools with one name",
        {"tools": [TOOL, TOOL]},
        "each function name must be unique; given more than once: calculator",
    ),
    (
        "a function name with spaces",
        {"tools": [{"type": "function", "function": {"name": "add numbers"}}]},
        "tools.0.function.name: String should match pattern",
    ),
    (
        "parameters that are not an object",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "parameters must describe an object (type 'object'), not type 'string'",
    ),
    (
        "tools with a raw prompt",
        {"messages": None, "prompt": "hi", "tools": [TOOL]},
        "tools and tool turns belong to a chat (`messages`)",
    ),
    (
        "a trace forced to call",
        {"mode": "trace", "max_tokens": None, "tools": [TOOL], "tool_choice": "required"},
        "a trace job generates nothing, so tool_choice 'required'",
    ),
    (
        "a schema the grammar library cannot enforce",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "r",
                    "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
                },
            }
        },
        'response_format.json_schema.schema: Unimplemented keys: ["not"]',
    ),
    (
        "tool parameters the grammar library cannot enforce, when the call is forced",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "string", "format": "made-up"}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters:",
    ),
    (
        "both a forced call and a JSON reply",
        {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "give one of them",
    ),
]


@pytest.mark.parametrize(("case", "changes", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_input_is_a_clear_4xx_and_nothing_is_queued(http, redis_client, case, changes, message):
    before = job_count(redis_client)
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **changes}
    response = http.post("/jobs", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code in (400, 422), response.text
    assert message in response.json()["detail"], response.json()["detail"]
    assert job_count(redis_client) == before


def test_openai_client_gets_the_same_refusals(client, redis_client):
    before = job_count(redis_client)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "hi"}],
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "weather"}},
        )
    assert "tool_choice names function 'weather', which is not among the tools (calculator)" in str(raised.value)
    assert job_count(redis_client) == before

"""Agent frameworks and SDKs as clients of `actq serve`, with tools and structured output, as a
user would write them: LangChain (`bind_tools` with a tool round trip, `with_structured_output`),
instructor (TOOLS, JSON and JSON_SCHEMA modes) and the openai SDK's `chat.completions.parse`.

Each test also reads what the client put on the wire (an httpx event hook), so that a client
that changes what it sends shows here as such, not as a mystery. Replies are checked against
independent references: the tool model's round trip against plain transformers with the
tokenizer's own tool template; constrained JSON against tests/support/constrained_reference.py
(transformers `generate` masked by llguidance directly, not by worker/rules/constrained.py), one
request alone and several in one batch with free rows among them.

The tiny model is random: its schemas bound every string, number and array and forbid extra
keys, so the grammar ends the JSON (and forces EOS) well within max_tokens. Its context is 256
tokens, and a tool call on it goes through actq's fallback prompt (the tools in a system
message, about 120 tokens), so the tool schemas used with it are small.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import instructor
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from shared.calculator import TOOL, TOOL_NAME, calculate_arguments
from shared.grammars import MAX_CALLS
from tests.e2e.conftest import TOOL_MODEL
from tests.support.constrained_reference import ConstrainedReference
from tests.support.stack import SMOL, TINY
from tests.support.tool_model import POOL, final_answer, problems

pytestmark = pytest.mark.model

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class Pet(BaseModel):
    """A pet, every field bounded."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=20)
    name: str = Field(max_length=8)


class Light(BaseModel):
    """A lamp."""

    model_config = ConfigDict(extra="forbid")
    on: bool


class Note(BaseModel):
    """For JSON mode, where the grammar is any JSON object and the schema is only in the prompt: a
    random model follows no prompt, so the field has a default (the tiny model writes `{}` here,
    the reference says so too)."""

    text: str = ""


class Wire:
    """The JSON bodies a client POSTs, in order (an httpx request hook)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.client = httpx.Client(event_hooks={"request": [self._record]}, timeout=300)

    def _record(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.sent.append(json.loads(request.content))

    def last(self) -> dict[str, Any]:
        """The last body sent, without its messages."""
        return {k: v for k, v in self.sent[-1].items() if k != "messages"}


@pytest.fixture
def wire() -> Iterator[Wire]:
    w = Wire()
    yield w
    w.client.close()


@pytest.fixture
def sdk(live, wire) -> Iterator[OpenAI]:
    """The openai client, retries off (a refusal shows, not retried away)."""
    with OpenAI(base_url=live.base_url + "/v1", api_key="unused", http_client=wire.client, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir) -> ConstrainedReference:
    return ConstrainedReference(tiny_dir)


@pytest.fixture(scope="module")
def tool_reference(tool_model_dir) -> ConstrainedReference:
    return ConstrainedReference(tool_model_dir)


def chat_model(live, wire: Wire, model: str, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=live.base_url + "/v1",
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        http_client=wire.client,
    )


def strict_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The schema as strict clients send it: Pydantic's, with additionalProperties false (from
    extra="forbid")."""
    schema = model.model_json_schema()
    assert schema["additionalProperties"] is False
    return schema


# -- LangChain ------------------------------------------------------------------------------------


def test_langchain_bind_tools_round_trip_equals_transformers(live_tools, wire, tool_reference):
    seen = {p.question for p in problems(POOL, seed=0)}
    problem = next(p for p in problems(40, seed=778) if p.question not in seen)
    llm = chat_model(live_tools, wire, TOOL_MODEL, 48).bind_tools([TOOL])
    question = [HumanMessage(problem.question)]
    first = llm.invoke(question)
    assert wire.last() == {
        "model": TOOL_MODEL,
        "stream": False,
        "max_completion_tokens": 48,
        "temperature": 0.0,
        "tools": [TOOL],  # the dict as given; no tool_choice: "auto"
    }
    written = tool_reference.generate([{"role": "user", "content": problem.question}], 48, tools=[TOOL])
    (call,) = [json.loads(m) for m in CALL.findall(written)]
    assert isinstance(first, AIMessage) and first.content == ""
    assert first.response_metadata["finish_reason"] == "tool_calls"
    (made,) = first.tool_calls
    assert made["name"] == call["name"] == TOOL_NAME
    assert made["args"] == call["arguments"] == {"expression": problem.expression}

    result = calculate_arguments(made["args"]).text
    turns = [*question, first, ToolMessage(result, tool_call_id=made["id"])]
    second = llm.invoke(turns)
    messages = wire.sent[-1]["messages"]
    assert messages[1]["tool_calls"] == [
        {
            "type": "function",
            "id": made["id"],
            "function": {"name": TOOL_NAME, "arguments": json.dumps(made["args"])},
        }
    ]
    assert messages[2] == {"role": "tool", "content": result, "tool_call_id": made["id"]}
    answer = tool_reference.generate(
        [
            {"role": "user", "content": problem.question},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "name": TOOL_NAME, "content": result},
        ],
        48,
        tools=[TOOL],
    )
    assert second.tool_calls == []
    assert second.content == answer == final_answer(problem.answer)


def test_langchain_structured_output_json_schema(live, wire, tiny_reference):
    llm = chat_model(live, wire, TINY, 60).with_structured_output(Pet, method="json_schema")
    pet = llm.invoke("Describe a pet.")
    sent = wire.last()
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Pet", "schema": strict_schema(Pet), "strict": True},
    }
    assert "tools" not in sent and "tool_choice" not in sent
    assert isinstance(pet, Pet)
    expected = tiny_reference.generate(wire.sent[-1]["messages"], 60, sent["response_format"])
    assert pet == Pet.model_validate_json(expected)


def test_langchain_structured_output_function_calling(live, wire):
    llm = chat_model(live, wire, TINY, 40).with_structured_output(Light, method="function_calling")
    light = llm.invoke("Is the lamp on?")
    sent = wire.last()
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "Light"}}
    assert sent["parallel_tool_calls"] is False
    (tool,) = sent["tools"]
    assert tool["function"]["name"] == "Light" and tool["function"]["parameters"]["properties"] == {
        "on": {"type": "boolean"}
    }
    assert isinstance(light, Light)


# -- instructor -----------------------------------------------------------------------------------


def test_instructor_tools_mode(sdk, wire):
    client = instructor.from_openai(sdk, mode=instructor.Mode.TOOLS)
    messages = [{"role": "user", "content": "Is the lamp on?"}]
    light = client.chat.completions.create(
        model=TINY, response_model=Light, messages=messages, max_tokens=40, temperature=0, max_retries=0
    )
    assert isinstance(light, Light)
    sent = wire.last()
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "Light"}}
    (tool,) = sent["tools"]
    assert tool["function"]["name"] == "Light" and "strict" not in tool["function"]
    parameters = tool["function"]["parameters"]
    assert (
        parameters["properties"] == strict_schema(Light)["properties"] and parameters["additionalProperties"] is False
    )
    assert "response_format" not in sent


def test_instructor_json_mode_equals_the_reference(sdk, wire, tiny_reference):
    client = instructor.from_openai(sdk, mode=instructor.Mode.JSON)
    messages = [{"role": "user", "content": "Notes, please."}]
    note, completion = client.chat.completions.create_with_completion(
        model=TINY, response_model=Note, messages=messages, max_tokens=40, temperature=0, max_retries=0
    )
    sent = wire.sent[-1]
    assert sent["response_format"] == {"type": "json_object"} and "tools" not in sent
    system, user = sent["messages"]
    assert system["role"] == "system" and json.dumps(Note.model_json_schema(), indent=2) in system["content"]
    assert user == messages[0]
    text = completion.choices[0].message.content
    assert text == tiny_reference.generate(sent["messages"], 40, {"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    assert isinstance(note, Note) and note.model_dump() == Note.model_validate_json(text).model_dump()


def test_instructor_json_schema_mode_equals_the_reference(sdk, wire, tiny_reference):
    client = instructor.from_openai(sdk, mode=instructor.Mode.JSON_SCHEMA)
    messages = [{"role": "user", "content": "Describe a pet."}]
    pet = client.chat.completions.create(
        model=TINY, response_model=Pet, messages=messages, max_tokens=60, temperature=0, max_retries=0
    )
    sent = wire.last()
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Pet", "schema": Pet.model_json_schema()},  # no "strict"
    }
    expected = Pet.model_validate_json(tiny_reference.generate(messages, 60, sent["response_format"]))
    assert isinstance(pet, Pet) and pet.model_dump() == expected.model_dump()


# -- the openai SDK's parse -----------------------------------------------------------------------


def test_parse_with_a_pydantic_response_format(sdk, wire, tiny_reference):
    messages = [{"role": "user", "content": "Describe a pet."}]
    reply = sdk.chat.completions.parse(model=TINY, messages=messages, response_format=Pet, max_tokens=60, temperature=0)
    sent = wire.last()
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Pet", "schema": strict_schema(Pet), "strict": True},
    }
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop"
    assert message.content == tiny_reference.generate(messages, 60, sent["response_format"])
    assert isinstance(message.parsed, Pet) and message.parsed == Pet.model_validate_json(message.content)


def test_parse_with_a_strict_function_tool(sdk, wire):
    reply = sdk.chat.completions.parse(
        model=TINY,
        messages=[{"role": "user", "content": "Is the lamp on?"}],
        tools=[openai.pydantic_function_tool(Light)],
        tool_choice={"type": "function", "function": {"name": "Light"}},
        max_tokens=36,  # the call is 27 tokens; the prompt 218 of the context's 256
        temperature=0,
    )
    (tool,) = wire.last()["tools"]
    assert tool["function"]["strict"] is True
    assert tool["function"]["parameters"]["additionalProperties"] is False
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "Light"
    assert isinstance(call.function.parsed_arguments, Light)
    assert call.function.parsed_arguments == Light.model_validate_json(call.function.arguments)


# -- constrained decoding against the independent reference ---------------------------------------

TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "size": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["w"],
            "additionalProperties": False,
        },
    },
    "required": ["tags", "size"],
    "additionalProperties": False,
}


def json_schema(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_a_json_schema_reply_is_the_reference_text(http, tiny_reference):
    messages = [{"role": "user", "content": "Tag it."}]
    body = {"model": TINY, "messages": messages, "max_tokens": 60, "temperature": 0}
    body["response_format"] = json_schema("tags", TAGS)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    expected = tiny_reference.generate(messages, 60, body["response_format"])
    assert choice["message"]["content"] == expected and choice["finish_reason"] == "stop"
    assert set(json.loads(expected)) == {"tags", "size"}


def test_a_batch_of_constrained_and_free_rows_each_equals_its_reference(live, http, tiny_reference):
    formats: list[dict[str, Any] | None] = [
        json_schema("pet", strict_schema(Pet)),
        None,
        json_schema("tags", TAGS),
        json_schema("light", strict_schema(Light)),
        None,
        {"type": "json_object"},
    ]
    entries = []
    for i, response_format in enumerate(formats):
        entry: dict[str, Any] = {
            "model": TINY,
            "messages": [{"role": "user", "content": f"Item {i}, please."}],
            "max_tokens": 20 + 8 * i,
            "temperature": 0,
        }
        if response_format is not None:
            entry["response_format"] = response_format
        entries.append(entry)
    response = http.post("/jobs/batch", json={"jobs": [{"request": entry} for entry in entries]})
    assert response.status_code == 202, response.text
    jobs = [live.wait(http, item["id"]) for item in response.json()["jobs"]]
    # constrained and free rows were decoded at the same time (in one batch of the engine)
    spans = [(j["started_at"], j["finished_at"], "response_format" in e) for e, j in zip(entries, jobs, strict=True)]
    assert any(a[2] and not b[2] and a[0] < b[1] and b[0] < a[1] for a in spans for b in spans), spans
    for entry, job in zip(entries, jobs, strict=True):
        assert job["status"] == "succeeded", job
        expected = tiny_reference.generate(entry["messages"], entry["max_tokens"], entry.get("response_format"))
        assert job["result"]["text"] == expected, entry
        if "response_format" in entry:
            assert job["result"]["finish_reason"] == "stop" and isinstance(json.loads(expected), dict)


# -- forced calls end: SmolLM2 at max_tokens 60 ---------------------------------------------------
# The built-in model, made to call the calculator, repeats its call until the length runs out. A
# forced reply must still answer its complete calls (finish_reason "tool_calls"), never a cut
# `<tool_call>` fragment in the content, and never the same call twice.

CALC_QUESTION = [{"role": "user", "content": "What is 12 times 7? Use the calculator."}]
STRICT_TOOL = {**TOOL, "function": {**TOOL["function"], "strict": True}}  # parse() reads only strict tools


class Arithmetic(BaseModel):
    """instructor's TOOLS-mode model as users write it: no extra="forbid", so pydantic's schema
    leaves other keys open (JSON Schema) and actq closes them (OpenAI's reading)."""

    operation: Literal["add", "subtract", "multiply", "divide"]
    result: int


def check_calls(calls: list[Any], raw: str) -> None:
    """Each call once, its arguments only the calculator's one key, and the raw text shows the
    model went on to another (cut or repeated) call that is not among them."""
    arguments = [call.function.arguments for call in calls]
    assert calls and len(set(arguments)) == len(arguments), arguments
    assert all(
        call.function.name == TOOL_NAME and set(json.loads(a)) == {"expression"}
        for call, a in zip(calls, arguments, strict=True)
    )
    assert raw.count("<tool_call>") > len(calls), raw  # what was dropped: the raw text keeps it


def test_sdk_required_at_max_tokens_60_answers_the_complete_call(live_smol, http, sdk):
    reply = sdk.chat.completions.parse(  # raised LengthFinishReasonError when a cut call left "length"
        model=SMOL, messages=CALC_QUESTION, tools=[STRICT_TOOL], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    job = http.get(f"/jobs/{reply.model_extra['actq']['job_id']}").json()
    assert job["result"]["usage"]["completion_tokens"] == 60  # the length did run out
    check_calls(choice.message.tool_calls or [], job["result"]["text"])
    longer = sdk.chat.completions.create(
        model=SMOL, messages=CALC_QUESTION, tools=[TOOL], tool_choice="required", max_tokens=200, temperature=0
    )
    assert longer.choices[0].finish_reason == "tool_calls" and longer.choices[0].message.content is None
    assert len(longer.choices[0].message.tool_calls or []) <= MAX_CALLS
    job = http.get(f"/jobs/{longer.model_extra['actq']['job_id']}").json()
    check_calls(longer.choices[0].message.tool_calls or [], job["result"]["text"])  # its repeats dropped


def test_langchain_bind_tools_any_at_max_tokens_60_returns_calls_not_fragments(live_smol, wire):
    llm = chat_model(live_smol, wire, SMOL, 60).bind_tools([TOOL], tool_choice="any")
    message = llm.invoke(CALC_QUESTION[0]["content"])
    assert wire.last()["tool_choice"] == "required"
    assert message.content == "" and "<tool_call>" not in json.dumps(message.model_dump())
    assert message.tool_calls and not message.invalid_tool_calls
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert all(call["name"] == TOOL_NAME and set(call["args"]) == {"expression"} for call in message.tool_calls)


def test_instructor_tools_mode_at_max_tokens_60_gets_only_the_models_fields(live_smol, sdk, wire):
    client = instructor.from_openai(sdk, mode=instructor.Mode.TOOLS)
    answer, completion = client.chat.completions.create_with_completion(
        model=SMOL, response_model=Arithmetic, messages=CALC_QUESTION, max_tokens=60, temperature=0, max_retries=0
    )
    (tool,) = wire.last()["tools"]
    assert "additionalProperties" not in tool["function"]["parameters"]  # sent open, as pydantic writes it
    assert isinstance(answer, Arithmetic)
    (call,) = completion.choices[0].message.tool_calls
    assert set(json.loads(call.function.arguments)) <= {"operation", "result"}  # invented no key

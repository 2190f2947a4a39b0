"""Tools and structured output in a job request: OpenAI's `tools`, `tool_choice`,
`response_format`, and the tool turns of a conversation (docs/openai.md, "Tools and structured output").

The shapes are OpenAI's: a tool is `{"type": "function", "function": {"name", "description",
"parameters", "strict"}}`; `tool_choice` is "auto", "none", "required" or
`{"type": "function", "function": {"name": ...}}`; an assistant message may carry `tool_calls`
(`{"id", "type": "function", "function": {"name", "arguments"}}`, the arguments a JSON object
written as a string), and a `role: "tool"` message answers one call by its `tool_call_id`.

What is checked here, on every parse of a request (structure only, cheap): names, unique tool
names, a named `tool_choice` among the tools, arguments that are JSON objects of bounded depth,
tool messages that answer a call made earlier in the conversation and not yet answered. What
scales with a schema (its size and depth, the metaschema of draft 2020-12: shared/schema_checks.py;
whether the constrained decoder can compile it: shared/grammars.py) costs more and runs once, at
submit, off the API's event loop (`request_schemas` lists what it checks).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from shared.closed_schemas import closed
from shared.schema_checks import arguments_problem

MAX_TOOLS = 128  # as OpenAI
MAX_TOOL_CALLS = 128  # per assistant message
MAX_ARGUMENTS_CHARS = 100_000
MAX_DESCRIPTION_CHARS = 10_000
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's function and schema names
CALL_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class ToolFormat(StrEnum):
    """How a model writes a tool call (worker/rules/tool_calls.py reads both)."""

    HERMES = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, Hermes, SmolLM3)
    LLAMA3_JSON = "llama3_json"  # {"name": ..., "parameters": {...}}, optionally after <|python_tag|> (Llama 3.x)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    # A JSON Schema of the arguments (an object); none: a function without arguments
    parameters: dict[str, Any] | None = None  # checked at submit: shared/schema_checks.py
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        kind = value.get("type")
        if kind is not None and kind != "object":
            raise ValueError(f"parameters must describe an object (type 'object'), not type {kind!r}")
        return value


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def rendered(self) -> dict[str, Any]:
        """The tool as chat templates take it (parameters filled in for a function without any)."""
        function = self.function.model_dump(exclude_none=True)
        function.setdefault("parameters", {"type": "object", "properties": {}})
        return {"type": "function", "function": function}


class FunctionName(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENTS_CHARS)]  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        if (problem := arguments_problem(value)) is not None:
            raise ValueError(problem)
        return value

    def argument_values(self) -> dict[str, Any]:
        values: dict[str, Any] = json.loads(self.arguments)
        return values


class ToolCall(_Strict):
    """One call of an assistant message (OpenAI's `tool_calls` item)."""

    id: Annotated[str, Field(pattern=CALL_ID_PATTERN)]
    type: Literal["function"] = "function"
    function: FunctionCall


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)
    name: Annotated[str, Field(pattern=NAME_PATTERN)] = "response"
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)] | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]  # checked at submit: shared/schema_checks.py
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """`text` (the default: free text), `json_object` (any JSON object), `json_schema` (JSON that
    validates against `json_schema.schema`); the last two are enforced by constrained decoding."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "response_format of type 'json_schema' needs `json_schema`: {'name': ..., 'schema': {...}}"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"`json_schema` belongs to response_format type 'json_schema', not {self.type!r}")
        return self

    def json_schema_of(self) -> dict[str, Any] | None:
        """The schema the output must satisfy (None: free text): objects that list `properties` are
        closed to other keys unless `strict` is false (shared/closed_schemas.py)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = self.json_schema.schema_
            return schema if self.json_schema.strict is False else closed(schema)
        return None


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """Unique names, and a tool_choice that names one of the tools; ValueError otherwise."""
    names = [t.function.name for t in tools or []]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools: each function name must be unique; given more than once: {', '.join(twice)}")
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:
        raise ValueError(f"tool_choice {_choice_text(tool_choice)} needs `tools`: give the functions to call")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(
            f"tool_choice names function {tool_choice.function.name!r}, which is not among the tools "
            f"({', '.join(names)})"
        )


def _choice_text(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def forced_calls(tool_choice: ToolChoice | None, tools: list[Tool] | None) -> list[Tool] | None:
    """The tools one of which the reply must call (constrained decoding), or None when the model
    is free: `required` (any of the tools) or a named function (that one)."""
    if not tools or tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        return [t for t in tools if t.function.name == tool_choice.function.name]
    return list(tools)

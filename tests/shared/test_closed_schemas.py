"""shared/closed_schemas.py: object schemas that list `properties` are closed to other keys, as
OpenAI's structured outputs and xgrammar's strict mode read them, unless the request opts out.
What a grammar accepts is checked by running bytes through llguidance's own matcher, and
every accepted reply is validated by jsonschema against the schema as the client wrote it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest
from pydantic import BaseModel

from shared.closed_schemas import closed
from shared.grammars import grammar_for
from shared.schemas import JobRequest
from shared.tools import ToolFormat

BYTES = llguidance.LLTokenizer("byte")


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(BYTES.greedy_tokenize(text)) and matcher.is_accepting())


def output_grammar(schema: dict[str, Any], strict: bool | None = None) -> str:
    spec: dict[str, Any] = {"name": "reply", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    request = JobRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": spec},
        }
    )
    grammar = grammar_for(request, None)
    assert grammar is not None
    return grammar


class Result(BaseModel):
    """instructor's TOOLS-mode response model as a user writes it: pydantic's schema has no
    additionalProperties, so JSON Schema leaves it open."""

    operation: str
    result: int


INVENTED = '{"operation": "add", "result": 12, "maximum": 10, "minimum": 0, "title": "Result", "type": "integer"}'
LISTED = '{"operation": "add", "result": 12}'


def test_a_pydantic_schema_refuses_invented_keys_by_default():
    schema = Result.model_json_schema()
    assert "additionalProperties" not in schema
    jsonschema.validate(json.loads(INVENTED), schema)  # open as written: JSON Schema allows the extra keys
    grammar = output_grammar(schema)
    assert accepts(grammar, LISTED) and not accepts(grammar, INVENTED)


def test_strict_false_keeps_the_schema_as_written():
    grammar = output_grammar(Result.model_json_schema(), strict=False)
    assert accepts(grammar, LISTED) and accepts(grammar, INVENTED)


def test_an_object_that_says_additional_properties_true_stays_open():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    grammar = output_grammar(schema)
    assert accepts(grammar, '{"a": 1, "b": 2}')
    typed = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert accepts(output_grammar(typed), '{"a": 1, "b": "x"}') and not accepts(
        output_grammar(typed), '{"a": 1, "b": 2}'
    )


def test_nested_objects_arrays_defs_and_choices_are_closed():
    class Inner(BaseModel):
        x: int

    class Outer(BaseModel):
        inner: Inner
        items: list[Inner]
        maybe: Inner | None = None

    schema = Outer.model_json_schema()  # Inner is under $defs, reached by $ref, in an array and in anyOf
    grammar = output_grammar(schema)
    good = {"inner": {"x": 1}, "items": [{"x": 2}], "maybe": {"x": 3}}
    assert accepts(grammar, json.dumps(good))
    for path in (("inner",), ("items", 0), ("maybe",)):
        bad = json.loads(json.dumps(good))
        target = bad
        for step in path:
            target = target[step]
        target["y"] = 0
        jsonschema.validate(bad, schema)
        assert not accepts(grammar, json.dumps(bad)), path
    assert not accepts(grammar, json.dumps({**good, "extra": 1}))


def test_a_forced_tool_call_refuses_invented_argument_keys_unless_the_function_is_not_strict():
    function = {"name": "record", "parameters": Result.model_json_schema()}
    calls = '<tool_call>\n{"name": "record", "arguments": %s}\n</tool_call>'
    for strict, extra_allowed in ((None, False), (True, False), (False, True)):
        tool = {"type": "function", "function": {**function, **({} if strict is None else {"strict": strict})}}
        request = JobRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "record"}},
            }
        )
        grammar = grammar_for(request, ToolFormat.HERMES)
        assert grammar is not None
        assert accepts(grammar, calls % LISTED)
        assert accepts(grammar, calls % INVENTED) is extra_allowed, strict


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # json_object: any object, never only {}
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
        {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        {"$ref": "#/$defs/A", "properties": {"b": {}}, "$defs": {"A": {"type": "object"}}},
    ],
    ids=["no-properties", "pattern-properties", "unevaluated", "all-of-members", "beside-ref"],
)
def test_objects_that_say_how_other_keys_go_or_combine_are_left_as_written(schema):
    assert closed(schema) == schema


def test_closing_does_not_change_the_request_and_reaches_every_schema_position():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"type": {"type": "string"}}}},
        "$defs": {"d": {"properties": {"a": {}}}},
        "items": {"properties": {"b": {}}},
        "prefixItems": [{"properties": {"c": {}}}],
        "allOf": [{"properties": {"e": {"properties": {"f": {}}}}}],
    }
    before = json.dumps(schema)
    out = closed(schema)
    assert json.dumps(schema) == before
    assert out["additionalProperties"] is False
    # a property named "properties" is a schema, and its own "type" property is not a keyword
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["properties"]["properties"]["type"]
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["items"]["additionalProperties"] is False
    assert out["prefixItems"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]  # an allOf member is left open...
    assert out["allOf"][0]["properties"]["e"]["additionalProperties"] is False  # ...not what is inside it

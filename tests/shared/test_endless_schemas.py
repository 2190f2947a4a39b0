"""shared/endless_schemas.py: parts of a schema a reply can start but never finish, found before
anything compiles; and grammar_problem refusing them, where llguidance's matcher, given the
schema, lets a reply open such a part and then only go deeper."""

from __future__ import annotations

from typing import Any

import llguidance
import pytest

from shared.endless_schemas import endless_part
from shared.grammars import grammar_for, grammar_problem
from shared.schemas import JobRequest

BYTES = llguidance.LLTokenizer("byte")
SELF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d"}}, "required": ["a"]}  # every value: {"a": {"a": ...


def request(schema: dict[str, Any]) -> JobRequest:
    return JobRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        }
    )


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        # found by CI's Hypothesis test: passed the submit check, failed mid-reply with "Too many items"
        (
            {"$defs": {"d": SELF}, "anyOf": [{"type": "array", "items": {"$ref": "#/$defs/d"}, "maxItems": 1}]},
            "#/anyOf/0/items",
        ),
        ({"$defs": {"d": SELF}, "type": "object", "properties": {"o": {"$ref": "#/$defs/d"}}}, "#/properties/o"),
        ({"$defs": {"d": SELF}, "anyOf": [{"type": "null"}, {"$ref": "#/$defs/d"}]}, "#/anyOf/1"),
        ({"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 1}}, "$ref": "#/$defs/t"}, "#"),
        ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "#"),
    ],
    ids=["array-item", "optional-property", "branch", "min-items", "root"],
)
def test_a_part_whose_every_value_is_endless_is_found(schema, pointer):
    assert endless_part(schema) == pointer


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional recursion: a list ends
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}},
                    "required": ["next"],
                }
            },
            "$ref": "#/$defs/n",
        },  # required, with a way out at each level
        {"$defs": {"d": SELF}, "type": "array", "items": {"$ref": "#/$defs/d"}, "maxItems": 0},  # no room for one
        {"$defs": {"d": SELF}, "type": "string"},  # defined, never reachable
        {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: any non-object value will do
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    ],
    ids=["optional", "way-out", "no-room", "unreachable", "untyped", "plain"],
)
def test_schemas_with_a_way_out_are_left_alone(schema):
    assert endless_part(schema) is None
    assert grammar_problem(request(schema), None) is None


def test_the_gap_is_refused_at_submit_and_its_grammar_would_let_a_reply_open_an_endless_item():
    schema = {"$defs": {"d": SELF}, "anyOf": [{"type": "array", "items": {"$ref": "#/$defs/d"}, "maxItems": 1}]}
    grammar = grammar_for(request(schema), None)
    assert grammar is not None
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert matcher.consume_tokens(BYTES.greedy_tokenize('[{"a": {"a": {"a": '))  # the grammar lets it in...
    assert not matcher.is_accepting()  # ...and no end is in sight
    problem = grammar_problem(request(schema), None)
    assert problem is not None and "#/anyOf/0/items can be started but never finished" in problem

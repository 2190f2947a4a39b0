"""The checks a request's JSON Schemas pass before anything compiles them (shared/schema_checks.py)
and the grammar check after them (shared/grammars.py): depth measured without recursion, and no
schema, however deep or strange, makes either raise anything but a ValueError naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.grammars import grammar_problem
from shared.schema_checks import MAX_SCHEMA_DEPTH, arguments_problem, check_schema, self_reference, too_deep
from shared.schemas import JobRequest
from shared.tools import ToolFormat
from tests.support.schema_strategies import deep, nested_schemas

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=2), children, max_size=3),
    max_leaves=40,
)


def depth(value: Any) -> int:
    """Levels of objects and arrays, the recursive way (the reference)."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


@given(JSON, st.integers(0, 8))
def test_depth_is_what_a_recursive_walk_finds(value, limit):
    assert too_deep(value, limit) == (depth(value) > limit)


def test_any_depth_is_measured_and_refused_without_recursion():
    chain: list = []
    for _ in range(100_000):
        chain = [chain]
    assert too_deep(chain)
    with pytest.raises(ValueError, match=f"more than {MAX_SCHEMA_DEPTH} levels deep"):
        check_schema({"type": "array", "items": {"enum": [chain]}}, "response_format.json_schema.schema")
    assert "more than 64 levels deep" in str(arguments_problem('{"a": ' + "[" * 100_000))
    assert "more than 64 levels deep" in str(arguments_problem('{"a": ' + "[" * 70 + "]" * 70 + "}"))
    assert arguments_problem('{"a": [[1]]}') is None
    assert arguments_problem("[1]") == "arguments must be a JSON object written as a string, not list"


def _with_schema(schema: dict[str, Any], as_tool: bool) -> JobRequest:
    fields: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if as_tool:
        parameters = {"type": "object", "properties": {"q": schema}, "required": ["q"]}
        fields |= {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}
        fields |= {"tool_choice": "required"}
    else:
        fields |= {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    return JobRequest.model_validate(fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nested_schemas(), st.booleans())
def test_no_schema_makes_the_checks_raise(schema, as_tool):
    """Generated schemas, nested up to 120 levels, with cycles and unsatisfiable parts: the checks
    the API runs at submit give a reason naming the field, or None; they never raise another
    error (a RecursionError or llguidance's own error used to be a 500)."""
    request = _with_schema(schema, as_tool)
    where = "tools[0].function.parameters" if as_tool else "response_format.json_schema.schema"
    for field, value in request.schemas():
        assert field == where
        try:
            check_schema(value, field)
        except ValueError as exc:
            assert str(exc).startswith(where)
            return
    problem = grammar_problem(request, ToolFormat.HERMES)
    assert problem is None or problem.startswith(where), problem


def test_the_issues_schemas_are_refused_naming_their_field():
    for kind, levels in (("properties", 70), ("items", 300), ("anyOf", 300)):
        schema = deep({"type": "string"}, levels, kind)
        with pytest.raises(ValueError, match=r"^response_format.json_schema.schema nests"):
            check_schema(schema, "response_format.json_schema.schema")
    # within the depth limit, llguidance's own reader refuses 128 levels: a reason, not an exception
    assert "recursion limit" in str(grammar_problem(_with_schema(deep({}, 63, "properties"), False), None))
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    for cyclic, at in (({"$ref": "#"}, "'#'"), (cycle, "'#/\\$defs/a'")):
        with pytest.raises(ValueError, match=f"^x at {at} refers back to itself"):
            check_schema(cyclic, "x")
        # and were it let through, the grammar check finds it describes nothing
        assert "allows no value at all" in str(grammar_problem(_with_schema(cyclic, False), None))
    # left recursion with a base case: a value exists, but validators recurse on it forever
    with pytest.raises(ValueError, match="^x at '#' refers back to itself"):
        check_schema({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "x")
    # a reference under `properties` or `items` reads part of the value: no cycle
    check_schema({"type": "object", "properties": {"next": {"$ref": "#"}}}, "x")
    check_schema({"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/anyOf/1"}}]}, "x")


@given(JSON)
def test_a_schema_without_references_has_no_cycle(value):
    assert self_reference(value) is None

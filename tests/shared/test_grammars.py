"""shared/grammars.py: the grammar of a constrained reply, checked by running text through
llguidance's own matcher over its byte tokenizer (no model tokenizer: one byte a token), and
the answers for schemas it cannot enforce. What the grammar accepts is checked against
independent readers: json.loads and jsonschema for JSON, worker/tool_calls.parse_tool_calls
for tool calls."""

from __future__ import annotations

import enum
import json
from typing import Any

import jsonschema
import llguidance
import pytest
from pydantic import BaseModel, Field

from shared.grammars import MAX_CALLS, grammar_for, grammar_problem
from shared.schemas import JobRequest
from shared.tools import ToolFormat
from worker.rules.tool_calls import parse_tool_calls

BYTES = llguidance.LLTokenizer("byte")
MESSAGES = [{"role": "user", "content": "hi"}]


def accepts(grammar: str, text: str) -> bool:
    """Whether `text` is a complete reply under `grammar`."""
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(BYTES.greedy_tokenize(text)) and matcher.is_accepting())


def request(**fields: Any) -> JobRequest:
    return JobRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def schema_request(schema: dict[str, Any]) -> JobRequest:
    return request(response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})


class Status(enum.StrEnum):
    pending = "pending"
    shipped = "shipped"


class Customer(BaseModel):
    name: str
    vip: bool
    email: str | None = None


class Item(BaseModel):
    sku: str
    qty: int = Field(ge=1, le=100)


class Order(BaseModel):
    id: int
    customer: Customer
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Status
    tags: list[str]


ORDER = {
    "id": 7,
    "customer": {"name": "Ada", "vip": True, "email": None},
    "items": [{"sku": "AX-1", "qty": 2}, {"sku": "B", "qty": 100}],
    "status": "shipped",
    "tags": [],
}

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 40}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
# parameters with $defs and a $ref into them: the arguments' schema keeps its own root
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "$defs": {"unit": {"enum": ["cm", "in"]}},
            "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/unit"}, "n": {"type": "integer"}},
            "required": ["unit"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: no arguments, `{}` (as OpenAI reads it)
TOOLS = [CALC, LOOKUP, NOW]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_a_free_request_has_no_grammar():
    for req in (
        request(),
        request(tools=TOOLS),
        request(tools=TOOLS, tool_choice="auto"),
        request(tools=TOOLS, tool_choice="none"),
    ):
        assert grammar_for(req, ToolFormat.HERMES) is None
        assert grammar_problem(req, ToolFormat.HERMES) is None
    assert grammar_for(request(response_format={"type": "text"}), None) is None


def test_json_object_takes_any_object_written_as_json_dumps_writes_it():
    req = request(response_format={"type": "json_object"})
    assert grammar_problem(req, None) is None
    grammar = grammar_for(req, None)
    assert grammar is not None
    value = {"a": [1, 2.5, "x"], "b": {"c": None, "d": True}, "e": 'q"uote'}
    assert accepts(grammar, json.dumps(value))
    assert accepts(grammar, "{}")
    for not_an_object in ("[1, 2]", '"text"', "42", "null"):
        assert not accepts(grammar, not_an_object)
    assert not accepts(grammar, '{"a":1}')  # whitespace is fixed: ", " and ": "
    assert not accepts(grammar, '{"a": 1}  ')  # no trailing padding either
    assert not accepts(grammar, '{"a": 1')


def test_a_pydantic_schema_with_nested_objects_enums_and_arrays():
    schema = Order.model_json_schema()  # $defs and $refs, anyOf with null, an enum, bounded arrays
    req = schema_request(schema)
    assert grammar_problem(req, None) is None
    grammar = grammar_for(req, None)
    assert grammar is not None
    text = json.dumps(ORDER)
    Order.model_validate_json(text)  # the independent readers agree it is valid
    jsonschema.validate(json.loads(text), schema)
    assert accepts(grammar, text)
    invalid = [
        {**ORDER, "status": "lost"},  # not in the enum
        {k: v for k, v in ORDER.items() if k != "customer"},  # a required property missing
        {**ORDER, "items": []},  # fewer items than min_length
        {**ORDER, "items": [{"sku": "A", "qty": 0}]},  # below the minimum
        {**ORDER, "customer": {"name": "Ada", "vip": "yes"}},  # a nested type
    ]
    for value in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
        assert not accepts(grammar, json.dumps(value)), value


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_named_tool_choice_allows_exactly_one_call_of_that_function(fmt):
    req = request(tools=TOOLS, tool_choice=named("lookup"))
    assert grammar_problem(req, fmt) is None
    grammar = grammar_for(req, fmt)
    assert grammar is not None
    good = write_calls(fmt, [("lookup", {"unit": "cm", "n": 3})])
    assert accepts(grammar, good)
    parsed = parse_tool_calls(good, fmt, {"calculator", "lookup", "now"})
    assert [c.name for c in parsed.calls] == ["lookup"] and not parsed.problems
    jsonschema.validate(json.loads(parsed.calls[0].arguments), LOOKUP["function"]["parameters"])
    assert not accepts(grammar, write_calls(fmt, [("calculator", {"expression": "1"})]))  # another function
    assert not accepts(grammar, write_calls(fmt, [("lookup", {"unit": "km"})]))  # outside its $ref'd enum
    assert not accepts(grammar, write_calls(fmt, [("lookup", {"n": 3})]))  # "unit" is required
    assert not accepts(grammar, write_calls(fmt, [("lookup", {"unit": "cm"})] * 2))  # one call only
    assert not accepts(grammar, "I would rather not.")


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_required_allows_one_or_more_calls_of_any_tool(fmt):
    req = request(tools=TOOLS, tool_choice="required")
    grammar = grammar_for(req, fmt)
    assert grammar is not None and grammar_problem(req, fmt) is None
    calls = [("calculator", {"expression": "(2 + 3) * 4"}), ("now", {}), ("lookup", {"unit": "cm", "n": 3})]
    for count in (1, 2, 3):
        text = write_calls(fmt, calls[:count])
        assert accepts(grammar, text), text
        parsed = parse_tool_calls(text, fmt, {"calculator", "lookup", "now"})
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls[:count]
        assert parsed.content is None and not parsed.problems
    assert not accepts(grammar, "")
    assert not accepts(grammar, write_calls(fmt, [("calculator", {"expression": "1", "extra": 1})]))
    assert not accepts(grammar, write_calls(fmt, [("unknown", {})]))
    assert not accepts(grammar, write_calls(fmt, [("now", {"tz": "UTC"})]))  # listed no keys: takes none
    assert not accepts(grammar, write_calls(fmt, [("lookup", {"unit": "cm", "extra": 1})]))  # closed by default


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_required_without_parallel_calls_allows_exactly_one_call(fmt):
    req = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    grammar = grammar_for(req, fmt)
    assert grammar is not None and grammar_problem(req, fmt) is None
    calls = [("calculator", {"expression": "2 + 3"}), ("now", {})]
    assert accepts(grammar, write_calls(fmt, calls[:1])) and accepts(grammar, write_calls(fmt, calls[1:]))
    assert not accepts(grammar, write_calls(fmt, calls))


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_required_ends_after_each_call_and_must_end_after_max_calls(fmt):
    """A reply under "required" may end after any complete call, and after MAX_CALLS calls the
    end is all it may write: a model that would call on and on is ended."""
    req = request(tools=TOOLS, tool_choice="required")
    grammar = grammar_for(req, fmt)
    assert grammar is not None
    calls = [("calculator", {"expression": f"{i} + 1"}) for i in range(MAX_CALLS + 1)]
    for count in (1, MAX_CALLS):
        matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
        assert matcher.consume_tokens(BYTES.greedy_tokenize(write_calls(fmt, calls[:count])))
        assert matcher.is_accepting()  # the end of the reply is offered
        assert matcher.is_stopped() is (count == MAX_CALLS)  # ...and after the last call, nothing else
    assert not accepts(grammar, write_calls(fmt, calls))


def write_calls(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as the model's format writes them (the templates' `tojson` separators)."""
    if fmt is ToolFormat.HERMES:
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
            for name, arguments in calls
        )
    return "; ".join(json.dumps({"name": name, "parameters": arguments}) for name, arguments in calls)


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
        ({"type": "string", "format": "made-up"}, "made-up"),
        ({"$ref": "#/$defs/nowhere"}, "nowhere"),
        ({"type": "string", "pattern": "(?=a)a+"}, "look-around"),
    ],
)
def test_a_schema_llguidance_cannot_enforce_is_a_problem_that_says_why(schema, reason):
    message = grammar_problem(schema_request(schema), None)
    assert message is not None and message.startswith("response_format.json_schema.schema: ")
    assert reason in message and "\n" not in message


def test_a_tool_schema_it_cannot_enforce_names_the_tool():
    bad = {
        "type": "function",
        "function": {"name": "bad", "parameters": {"type": "object", "not": {"required": ["a"]}}},
    }
    req = request(tools=[CALC, bad], tool_choice="required")
    message = grammar_problem(req, ToolFormat.HERMES)
    assert message is not None and message.startswith("tools[1].function.parameters: ") and "not" in message
    # only the tools a reply may call are compiled: a named choice of another one is fine
    assert grammar_problem(request(tools=[CALC, bad], tool_choice=named("calculator")), ToolFormat.HERMES) is None


def test_forcing_a_call_on_a_model_without_a_tool_format_is_a_problem():
    req = request(tools=[CALC], tool_choice="required")
    message = grammar_problem(req, None)
    assert message is not None and "tool" in message
    with pytest.raises(ValueError, match="tool calls"):
        grammar_for(req, None)

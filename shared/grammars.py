"""The grammar a constrained reply follows, and whether the constrained decoder can compile it.

A request is constrained when it forces a tool call (`tool_choice` "required" or a named
function), asks for JSON (`response_format` json_object / json_schema) or gives vLLM's
`structured_outputs` (shared/structured_outputs.py). The grammar is
llguidance's (its JSON grammar text, what `llguidance.LLMatcher` takes), built here without a
tokenizer so the API can check it at submit (`grammar_problem`) and the worker compile the same
text (worker/rules/constrained.py).

- JSON output: the schema, as llguidance's JSON compiler reads it.
- structured_outputs `regex`: llguidance's regex grammar; `choice`: a Lark rule whose
  alternatives are the strings, as literals; `grammar`: the client's Lark text as it is.
- Forced tool calls: a Lark grammar whose calls are written as the model's tool format writes
  them (worker/rules/tool_calls.py reads them back): HERMES `<tool_call>\\n{"name": "f", "arguments":
  {...}}\\n</tool_call>`, several separated by "\\n" under "required" (one when
  parallel_tool_calls is false; at most MAX_CALLS); LLAMA3_JSON `{"name": "f", "parameters":
  {...}}`, several separated by "; ". Once a call is complete the end of the reply is allowed, and
  after the last one it is the only thing allowed. The call object's frame
  (the name as a JSON string constant, the key order) is literal text, and only the arguments
  are a `%json` sub-grammar: each tool's `parameters` schema stays a schema of its own, so its
  `$ref`s ("#/$defs/...") resolve against it as the client wrote them. A named tool_choice
  allows exactly one call, "required" one to MAX_CALLS, each of any of the tools.

Whitespace is fixed (`whitespace_flexible` off) with the separators `json.dumps` and chat
templates' `tojson` write, ", " and ": ": the model is made to write JSON the way it saw JSON in
training, and a model cannot pad a reply with endless whitespace.

What counts as a problem (`grammar_problem`): llguidance's JSON compiler runs strict (never
`lenient`), so a keyword it cannot enforce (`not`, `if`/`then`, `uniqueItems`, `contains`,
`propertyNames`, `unevaluatedProperties`, an unknown `format`, a regex look-around) and a `$ref`
to nowhere are errors, not warnings: a reply "constrained" by a schema whose keywords were
silently dropped could fail validation, which is what constraining promises never happens. Any
warning llguidance still gives is treated the same way, for the same reason. Annotations
(`title`, `description`, `default`, `examples`) are accepted. The check costs well under a
millisecond per schema (tests/shared/test_grammars.py; bench/bench_constrained.py measures it).

A grammar that compiles can still allow nothing: a schema that is only a `$ref` cycle (`{"$ref":
"#"}`, `a` -> `b` -> `a`) describes no value, and its "constrained" reply used to be "" with
finish_reason "stop". The check compiles the grammar for a tokenizer of the 256 bytes and asks
for the first mask: a grammar that allows no byte is refused. A schema whose every value is
endless (an object that requires itself: `{"x": {"x": ...`) allows a first byte, but forces
everything after it: llguidance's matcher gave up mid-reply ("Too many items"), failing the job.
Its forced prefix is measured (`compute_ff_bytes`), and one of MAX_FORCED_BYTES or more is
refused. Such a part below the root, reachable through an optional property, an array item or a
branch, is found by a static analysis (shared/endless_schemas.py) and refused too: the reply could
start it and never end. A cycle with a choice at each level (a way out) is finite and allowed;
its reply may still end with finish_reason "length", which is what constraining promises for a
reply cut short.
Whatever llguidance raises on a request's schema (its reader's recursion limit, a schema that is
not an object) is a problem of that field, never an exception.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

from shared.closed_schemas import closed
from shared.endless_schemas import endless_part
from shared.tools import Tool, ToolFormat

if TYPE_CHECKING:
    import llguidance

    from shared.schemas import JobRequest
    from shared.structured_outputs import StructuredOutputs

ITEM_SEPARATOR = ", "
KEY_SEPARATOR = ": "
# llguidance's JSON compiler options: fixed whitespace, the separators above, strict keywords
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ITEM_SEPARATOR,
    "key_separator": KEY_SEPARATOR,
    "lenient": False,
}
# Calls in one reply under tool_choice "required" with parallel calls: after the last, only the
# end of the reply. A model that would call on and on (small ones repeat one call) is ended.
MAX_CALLS = 8
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"
HERMES_BETWEEN = "\n"
LLAMA3_BETWEEN = "; "
_ARGUMENT_KEYS = {ToolFormat.HERMES: "arguments", ToolFormat.LLAMA3_JSON: "parameters"}


def grammar_for(request: JobRequest, fmt: ToolFormat | None) -> str | None:
    """The llguidance grammar the reply must follow, or None when the request is unconstrained.
    ValueError when tool calls are forced and the model has no tool-call format (`fmt` None)."""
    schema = request.output_schema
    if schema is not None:
        return _json_grammar(schema)
    if request.structured_outputs is not None:
        return _text_grammar(request.structured_outputs)
    forced = request.forced_tools
    if forced is None:
        return None
    if fmt is None:
        raise ValueError(_NO_FORMAT)
    return _calls_grammar(forced, fmt, several=request.several_calls)


def grammar_problem(request: JobRequest, fmt: ToolFormat | None) -> str | None:
    """None when the constrained decoder can compile the request's grammar (or there is none);
    otherwise what is wrong, in the request's terms (which field, llguidance's reason)."""
    schema = request.output_schema
    outputs = request.structured_outputs
    if schema is not None:
        if outputs is not None:
            where = f"structured_outputs.{outputs.kind}"
        elif request.response_format is not None and request.response_format.type == "json_schema":
            where = "response_format.json_schema.schema"
        else:
            where = "response_format"
        return _problem(lambda: _json_grammar(schema), where) or _endless(schema, where)
    if outputs is not None:
        problem = _problem(lambda: _text_grammar(outputs), f"structured_outputs.{outputs.kind}")
        if problem is not None and outputs.kind == "grammar":
            problem += " (a Lark grammar in llguidance's syntax, whose `start` rule is the reply; GBNF is not read)"
        return problem
    forced = request.forced_tools
    if forced is None:
        return None
    if fmt is None:
        return _NO_FORMAT
    index = {tool.function.name: i for i, tool in enumerate(request.tools or [])}
    for tool in forced:
        where = f"tools[{index[tool.function.name]}].function.parameters"
        problem = _problem(lambda tool=tool: _json_grammar(arguments_schema(tool)), where)  # type: ignore[misc]
        if (problem := problem or _endless(arguments_schema(tool), where)) is not None:
            return problem
    return _problem(lambda: _calls_grammar(forced, fmt, several=request.several_calls), "tool_choice")


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema a call's arguments follow: the tool's parameters as rendered to the model (an
    empty object schema for a function without any), always an object: parse_tool_calls takes
    nothing else as arguments. A top-level `type` is added, never a wrapper, so `$ref`s into the
    schema keep their meaning; objects that list `properties` are closed to other keys unless the
    function says `strict: false` (shared/closed_schemas.py)."""
    schema = dict(tool.rendered()["function"]["parameters"])
    schema.setdefault("type", "object")
    return schema if tool.function.strict is False else closed(schema)


def _json_grammar(schema: dict[str, Any]) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)  # type: ignore[arg-type]


def _text_grammar(outputs: StructuredOutputs) -> str:
    """The grammar of a `regex`, `choice` or `grammar` constraint (a JSON one goes by its schema)."""
    from llguidance import LLMatcher

    if outputs.regex is not None:
        return LLMatcher.grammar_from_regex(outputs.regex)
    if outputs.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(_lark_string, outputs.choice)) + "\n")
    assert outputs.grammar is not None
    return LLMatcher.grammar_from_lark(outputs.grammar)


def _calls_grammar(tools: list[Tool], fmt: ToolFormat, several: bool) -> str:
    """A Lark grammar: one call (`several`: one or more) of any of `tools`, as `fmt` writes calls."""
    from llguidance import LLMatcher

    key = _ARGUMENT_KEYS[fmt]
    rules = []
    for i, tool in enumerate(tools):
        head = "{" + json.dumps("name") + KEY_SEPARATOR + json.dumps(tool.function.name) + ITEM_SEPARATOR
        head += json.dumps(key) + KEY_SEPARATOR
        arguments = {**arguments_schema(tool), "x-guidance": JSON_OPTIONS}
        rules.append(f"fn_{i}: {_lark_string(head)} %json {json.dumps(arguments)} {_lark_string('}')}")
    calls = " | ".join(f"fn_{i}" for i in range(len(tools)))
    if fmt is ToolFormat.HERMES:
        call = f"call: {_lark_string(HERMES_OPEN)} ({calls}) {_lark_string(HERMES_CLOSE)}"
        between = HERMES_BETWEEN
    else:
        call = f"call: {calls}"
        between = LLAMA3_BETWEEN
    more = f"{{0,{MAX_CALLS - 1}}}"
    start = f"start: call ({_lark_string(between)} call){more}" if several else "start: call"
    return LLMatcher.grammar_from_lark("\n".join([start, call, *rules]) + "\n")


def _lark_string(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text)


def _endless(schema: dict[str, Any], where: str) -> str | None:
    """A part of the schema a reply could start but never finish (shared/endless_schemas.py)."""
    pointer = endless_part(schema)
    if pointer is None:
        return None
    return (
        f"{where}: the part at {pointer} can be started but never finished (every value of it requires itself "
        "again, through a required property or a minimum of items): make that reference optional, or give it "
        "something to end on"
    )


def _problem(build: Callable[[], str], where: str) -> str | None:
    """None when the grammar `build` makes compiles, strictly, and allows a first byte; otherwise
    what is wrong, naming `where`."""
    from llguidance import LLMatcher

    try:
        matcher = LLMatcher(_byte_tokenizer(), build(), log_level=0)
    except Exception as exc:  # noqa: BLE001 - whatever llguidance raises on a request's schema is that schema's problem
        return f"{where}: {_reason(str(exc) or type(exc).__name__)}"
    if matcher.is_error():
        return f"{where}: {_reason(matcher.get_error())}"
    warnings = matcher.get_grammar_warnings()
    if warnings:
        return f"{where}: {_reason(warnings[0])} (constraining would ignore it)"
    if not allows_a_value(matcher, BYTE_VOCAB, {BYTE_EOS}):
        return f"{where}: allows no value at all (" + (
            "a `$ref` cycle with no base case, e.g. a schema that is only a reference to itself): give every "
            "reference something to end on"
            if _is_schema(where)
            else "nothing the model could write matches it): give it something to match"
        )
    if len(matcher.compute_ff_bytes()) >= MAX_FORCED_BYTES:
        return f"{where}: forces {MAX_FORCED_BYTES:,} bytes or more before the model chooses anything (" + (
            "a required property or item that refers back to its own schema, so every value is endless): make "
            "the reference optional, or give it something to end on"
            if _is_schema(where)
            else "a regex, choice or grammar whose reply is that long and fixed): let the model choose sooner"
        )
    return None


def _is_schema(where: str) -> bool:
    """Whether the field a problem names holds a JSON Schema (not a regex, choice or Lark grammar)."""
    return not where.startswith(("structured_outputs.regex", "structured_outputs.choice", "structured_outputs.grammar"))


def allows_a_value(matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: set[int]) -> bool:
    """Whether the grammar, from the matcher's current state, allows some token other than EOS
    (its mask computed into a scratch bitmask); a grammar with no value puts the matcher in its
    error state."""
    import llguidance.numpy
    import numpy as np

    bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    if matcher.is_error():
        return False
    allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    allowed[[i for i in eos_ids if i < vocab_size]] = 0
    return bool(allowed.any())


def _reason(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:500]


BYTE_VOCAB, BYTE_EOS = 257, 256  # the 256 bytes, then EOS
# A grammar that forces this many bytes from its start writes itself without end (`{"x": {"x": ...`
# for an object that requires itself): llguidance's matcher fails on it mid-reply ("Too many
# items"), so it is refused at submit. No reply of a useful schema is forced that long.
MAX_FORCED_BYTES = 8192


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes (and EOS): what a grammar allows for it, any
    tokenizer that can write every byte can write."""

    eos_token_id = BYTE_EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [BYTE_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), slices=[])


_NO_FORMAT = (
    "tool_choice 'required' or a named function needs a model whose chat template writes tool calls; "
    "this model has none (leave tool_choice out or 'auto')"
)

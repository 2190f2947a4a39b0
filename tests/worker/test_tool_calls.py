"""worker/rules/tool_calls.py: the format picked from real chat templates, calls read back from what
those templates render (transformers' own `apply_chat_template`, the way the worker renders
prompts), and malformed calls reported, never guessed.

The templates are vLLM's examples, copied unmodified into tests/data/chat_templates (see the
README there). One finding: the stored version of vLLM's `tool_chat_template_hermes.jinja`
renders a past call as `{"name": "f"}, "arguments": {...}`, which is not one JSON object; the
parser reports it instead of guessing, and the format that template asks the model to write (its
own instructions, in the rendered system prompt) parses."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from worker.rules.tool_calls import (
    Parsed,
    Problem,
    ToolCall,
    ToolFormat,
    call_id,
    parse_tool_calls,
    template_family,
)

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
HERMES_VLLM = "tool_chat_template_hermes.jinja"
HERMES_2_PRO = "tool_chat_template_hermes_2_pro.jinja"
LLAMA3 = "tool_chat_template_llama3.1_json.jinja"
END_OF_TURN = {HERMES_VLLM: "<|im_end|>", HERMES_2_PRO: "<|im_end|>", LLAMA3: "<|eot_id|>"}
H, L = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression."}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {
                "type": "object",
                "properties": {
                    "word": {"type": "string", "description": "The word."},
                    "limit": {"type": "integer", "description": "How many senses."},
                },
                "required": ["word"],
            },
        },
    },
]
NAMES = {"calculator", "lookup"}
QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]
ARGUMENTS: list[dict[str, Any]] = [
    {"expression": "12 * 7"},
    # braces, brackets, quotes, a closing tag and a separator inside strings; unicode; escapes
    {"expression": '{[(1 + 2)]} * "3"; </tool_call> <tool_call>', "note": "héllo 日本語 😀 \\ \n"},
    {"word": "naïve", "limit": 3, "filters": {"lang": ["fr", "en"], "exact": True, "min": 0.5}},
]


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def compact(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def assistant_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI assistant message with one call, its arguments as the templates read them: a
    dict (both templates apply `tojson` to them; the worker turns OpenAI's JSON string into one)."""
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path):
    return AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)


def rendered_turn(tokenizer, name: str, message: dict[str, Any]) -> str:
    """What the model would generate for `message`: the conversation rendered with it, less the
    prompt rendered with the generation prompt, up to the end-of-turn token (the model's stop)."""
    text = template(name)
    prompt = tokenizer.apply_chat_template(
        QUESTION, tools=TOOLS, chat_template=text, tokenize=False, add_generation_prompt=True
    )
    full = tokenizer.apply_chat_template(QUESTION + [message], tools=TOOLS, chat_template=text, tokenize=False)
    assert full.startswith(prompt)
    turn = full[len(prompt) :]
    assert END_OF_TURN[name] in turn
    return turn[: turn.index(END_OF_TURN[name])]


# --- which format a template renders --------------------------------------------------------


@pytest.mark.parametrize(("name", "family"), [(HERMES_VLLM, H), (HERMES_2_PRO, H), (LLAMA3, L)])
def test_the_real_templates_family(name, family):
    assert template_family(template(name)) is family


def test_smollm2s_template_renders_no_tools(tokenizer):
    assert "tools" not in tokenizer.chat_template
    assert template_family(tokenizer.chat_template) is None


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "{% for m in messages %}{{ m.content }}{% endfor %}",  # no tools at all
        "{{ '<tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}",  # the tag, no tools
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",  # Mistral's
    ],
)
def test_templates_without_a_format_read_here_have_no_family(text):
    assert template_family(text) is None


# --- calls rendered by the real templates, read back ----------------------------------------


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=["plain", "tricky-strings", "nested"])
@pytest.mark.parametrize(("name", "fmt"), [(HERMES_2_PRO, H), (LLAMA3, L)])
def test_a_call_rendered_by_a_real_template_reads_back(tokenizer, name, fmt, arguments):
    tool = "lookup" if "word" in arguments else "calculator"
    turn = rendered_turn(tokenizer, name, assistant_call(tool, arguments))
    parsed = parse_tool_calls(turn, fmt, NAMES)
    assert parsed == Parsed(None, [ToolCall(tool, compact(arguments))], [])
    assert json.loads(parsed.calls[0].arguments) == arguments


def test_llama3s_calls_read_back_after_the_python_tag_and_separated_by_semicolons(tokenizer):
    """Llama 3 writes several calls as JSON objects separated by `;`, after `<|python_tag|>`; the
    template renders one call per turn, so the turns are joined the way the model writes them."""
    calls = [("calculator", ARGUMENTS[0]), ("lookup", ARGUMENTS[2]), ("calculator", ARGUMENTS[1])]
    turns = [rendered_turn(tokenizer, LLAMA3, assistant_call(tool, arguments)) for tool, arguments in calls]
    parsed = parse_tool_calls("<|python_tag|>" + "; ".join(turns), L, NAMES)
    assert parsed == Parsed(None, [ToolCall(tool, compact(arguments)) for tool, arguments in calls], [])


def instructed_call(tokenizer, name: str, tool: str, arguments: dict[str, Any]) -> str:
    """The call block a Hermes template's rendered system prompt tells the model to write,
    placeholders filled in."""
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, chat_template=template(name), tokenize=False)
    example = re.search(r"<tool_call>\n\{.*?\}\n</tool_call>", prompt)
    assert example is not None and "<function-name>" in example[0]
    filled = example[0].replace("<function-name>", json.dumps(tool)).replace("<args-dict>", json.dumps(arguments))
    return filled


@pytest.mark.parametrize("name", [HERMES_VLLM, HERMES_2_PRO])
def test_the_format_a_hermes_template_instructs_reads_back_several_calls_and_text(tokenizer, name):
    first = instructed_call(tokenizer, name, "calculator", ARGUMENTS[1])
    second = instructed_call(tokenizer, name, "lookup", ARGUMENTS[2])
    parsed = parse_tool_calls(f"I will compute it.\n{first}\n{second}", H, NAMES)
    expected = [ToolCall("calculator", compact(ARGUMENTS[1])), ToolCall("lookup", compact(ARGUMENTS[2]))]
    assert parsed == Parsed("I will compute it.", expected, [])


def test_vllms_hermes_template_renders_past_calls_that_do_not_parse_and_they_are_reported(tokenizer):
    turn = rendered_turn(tokenizer, HERMES_VLLM, assistant_call("calculator", ARGUMENTS[0]))
    assert '{"name": "calculator"}, "arguments": {"expression": "12 * 7"}' in turn  # not one object
    parsed = parse_tool_calls(turn, H, NAMES)
    assert parsed.calls == [] and parsed.content == turn
    assert [p.reason for p in parsed.problems] == ["text after the JSON object in <tool_call>"]


# --- malformed calls -----------------------------------------------------------------------

GOOD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
GOOD_CALL = ToolCall("calculator", '{"expression":"1 + 1"}')
OTHER = '<tool_call>\n{"name": "lookup", "arguments": {"key": "pi"}}\n</tool_call>'
OTHER_CALL = ToolCall("lookup", '{"key":"pi"}')


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}\n</tool_call>', "malformed JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1 +', "malformed JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": ["1 + 1"]}</tool_call>', "not an array"),
        ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>', "not a string"),
        ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>[{"name": "calculator", "arguments": {}}]</tool_call>', "no JSON object after <tool_call>"),
        ("<tool_call>calculator(expression='1')</tool_call>", "no JSON object after <tool_call>"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": NaN}}</tool_call>', "NaN is not JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": 1e999}}</tool_call>', "too large"),
        ('<tool_call>{"name": "calculator", "arguments": {}} and more</tool_call>', "text after the JSON"),
        pytest.param(
            '<tool_call>{"name": "calculator", "arguments": ' + "[" * 100_000 + "</tool_call>",
            "nested too deeply",
            id="nested-too-deeply",
        ),
        ('<tool_call>{"name": "lookup", "arguments": {}, "parameters": {}}</tool_call>', "both"),
    ],
)
def test_a_hermes_call_that_does_not_parse_is_a_problem_and_the_text_stays_plain(text, reason):
    parsed = parse_tool_calls(f"Let me see. {text}", H, NAMES)
    assert parsed.calls == [] and parsed.content == f"Let me see. {text}"
    assert [p.text for p in parsed.problems] == [text]
    assert reason in parsed.problems[0].reason


def test_a_bad_call_beside_good_ones_is_reported_and_stays_in_the_content():
    bad = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(f"{GOOD}\n{bad}\n{OTHER}", H, NAMES)
    assert parsed.calls == [GOOD_CALL, OTHER_CALL]
    assert parsed.content == bad and [p.text for p in parsed.problems] == [bad]


def test_an_unclosed_broken_call_does_not_swallow_the_next_one():
    parsed = parse_tool_calls('<tool_call>{"name": "calc\n' + GOOD, H, NAMES)
    assert parsed.calls == [GOOD_CALL]
    assert parsed.problems[0].text == '<tool_call>{"name": "calc\n'
    assert parsed.problems[0].reason.endswith("and no </tool_call>")


def test_a_whole_last_call_without_its_closing_tag_counts():
    """Generation can stop before the tag (`</tool_call>` as a stop string, for one)."""
    text = GOOD.removesuffix("</tool_call>")
    assert parse_tool_calls(text, H, NAMES) == Parsed(None, [GOOD_CALL], [])


def test_text_around_the_calls_is_the_content():
    parsed = parse_tool_calls(f"  Let me compute that.\n{GOOD}\n\n{OTHER}\nThen I will answer.\n", H, NAMES)
    assert parsed == Parsed("Let me compute that.\n\nThen I will answer.", [GOOD_CALL, OTHER_CALL], [])


def test_without_the_requests_tool_names_any_name_is_a_call():
    parsed = parse_tool_calls('<tool_call>{"name": "anything", "parameters": {}}</tool_call>', H, None)
    assert parsed == Parsed(None, [ToolCall("anything", "{}")], [])


def test_a_call_without_arguments_has_empty_ones():
    for text, fmt in [('<tool_call>{"name": "lookup"}</tool_call>', H), ('{"name": "lookup"}', L)]:
        assert parse_tool_calls(text, fmt, NAMES).calls == [ToolCall("lookup", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "The answer is 84.",
        "Sets look like {1, 2} and dicts like {'a': 1}.",
        'The result is {"result": 84}, as JSON.',
        "<|python_tag|>brave_search.call(query='weather')",
    ],
)
def test_llama3_text_without_calls_is_plain_content(text):
    assert parse_tool_calls(text, L, NAMES) == Parsed(text, [], [])


def test_hermes_text_without_calls_is_plain_content():
    text = 'No call here; just {"name": "calculator", "arguments": {}} in prose.'
    assert parse_tool_calls(text, H, NAMES) == Parsed(text, [], [])


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "calculator", "parameters": {"expression": "1"}', "malformed JSON"),
        ('<|python_tag|>{"name": calculator}', "malformed JSON"),
        ('Sure! {"name": "calculator", "parameters": {"expression": "1 +', "malformed JSON"),
        ('{"name": "search", "parameters": {}}', "unknown tool 'search'"),
        ('{"parameters": {"expression": "1"}}', 'no "name"'),
        ('{"name": "calculator", "parameters": [1, 2]}', "not an array"),
        ('{"name": "calculator", "parameters": 12}', "not a number"),
    ],
)
def test_a_llama3_call_that_does_not_parse_is_a_problem_and_the_text_stays_plain(text, reason):
    parsed = parse_tool_calls(text, L, NAMES)
    assert parsed.calls == [] and parsed.content == text
    assert len(parsed.problems) == 1 and reason in parsed.problems[0].reason


def test_llama3_text_around_calls_and_a_broken_last_call():
    good = '{"name": "calculator", "arguments": {"expression": "{1}"}}'
    other = '{"name": "calculator", "arguments": {"expression": "{2}"}}'
    parsed = parse_tool_calls(f'Calling.\n<|python_tag|>{good}; {other};{{"name": "lookup", "para', L, NAMES)
    calls = [ToolCall("calculator", '{"expression":"{1}"}'), ToolCall("calculator", '{"expression":"{2}"}')]
    assert parsed.calls == calls
    assert parsed.content == 'Calling.\n{"name": "lookup", "para'
    assert [p.text for p in parsed.problems] == ['{"name": "lookup", "para']


@pytest.mark.parametrize("fmt", [H, L])
def test_a_call_that_repeats_an_earlier_one_is_a_problem_not_a_second_call(fmt):
    """A small model made to call a tool repeats its call until the length runs out: the repeats
    add nothing, so each is reported and left out of the calls and the content."""
    if fmt is H:
        text = "\n".join([GOOD, OTHER, GOOD, GOOD])
    else:
        one, two = (
            '{"name": "calculator", "arguments": {"expression": "1 + 1"}}',
            '{"name": "lookup", "arguments": {"key": "pi"}}',
        )
        text = "; ".join([one, two, one, one])
    parsed = parse_tool_calls(text, fmt, NAMES)
    assert parsed.calls == [GOOD_CALL, OTHER_CALL] and parsed.content is None
    assert [p.reason for p in parsed.problems] == ["repeats call 1 (the same name and arguments)"] * 2
    different = parse_tool_calls(GOOD + "\n" + GOOD.replace("1 + 1", "1 + 2"), H, NAMES)
    assert len(different.calls) == 2  # the same tool with other arguments is another call


@pytest.mark.parametrize("forced", [False, True])
def test_a_call_cut_by_max_tokens_is_dropped_and_leaves_no_markup(forced):
    """The reply ran out of tokens inside its second call: the complete call stands, the cut one
    is a problem, and no `<tool_call>` fragment is left in the content, forced choice or not."""
    fragment = '<tool_call>\n{"name": "calculator", "arguments": {"expre'
    parsed = parse_tool_calls(f"{GOOD}\n{fragment}", H, NAMES, cut=True, forced=forced)
    assert parsed.calls == [GOOD_CALL] and parsed.content is None
    assert parsed.problems[0].text == fragment and parsed.problems[0].reason.startswith("cut short by max_tokens")
    prose = parse_tool_calls(f"I will compute it. {fragment}", H, NAMES, cut=True, forced=forced)
    assert prose.calls == [] and prose.content == "I will compute it."
    # not cut (the reply ended by itself): an unfinished call is the model's text, as vLLM leaves it...
    ended = parse_tool_calls(f"I will compute it. {fragment}", H, NAMES)
    assert ended.content == f"I will compute it. {fragment}"
    # ...unless the reply was made to be calls only
    assert parse_tool_calls(f"{GOOD}\n{fragment}", H, NAMES, forced=True).content is None


# --- the rest of the API -------------------------------------------------------------------


def test_call_ids_are_openais_shape_and_differ():
    ids = {call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_a_call_in_openais_shape():
    assert GOOD_CALL.openai("call_1") == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression":"1 + 1"}'},
    }


def test_a_problem_reads_as_its_reason_and_text():
    assert str(Problem("<tool_call>{", "malformed JSON")) == "malformed JSON: <tool_call>{"

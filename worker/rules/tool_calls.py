"""Tool calls read back from a completion, in the format the model's chat template taught it.

A model calls a tool by writing text: whatever format its chat template renders tool calls in
(the past calls of a conversation, and the instructions it gives with `tools`) is the format the
model was trained to write. So the worker picks the format from the template (`template_family`)
and parses the completion in it (`parse_tool_calls`), and the API answers in OpenAI's shape. This
module is pure (text in, values out: no tokenizer, no model); the caller keeps the raw completion
for audit, generates the calls' ids (`call_id`) and sets `finish_reason`.

Two families, the formats vLLM's `hermes` and `llama3_json` tool parsers read:

- `HERMES` (Qwen 2.5 and 3, Hermes 2 Pro and 3, SmolLM3...): each call is a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; any number of
  calls, with text around them.
- `LLAMA3_JSON` (Llama 3.1 to 3.3 with JSON tool calling): the call is a bare JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several are separated
  by `;`.

The rules, and where they differ from vLLM's parsers:

- A call is a JSON object with a non-empty string `name` (one of the request's tools when
  `tool_names` is given) and a JSON object under `arguments` or `parameters` (either key in both
  families, as vLLM's llama3_json parser accepts; a model drifts between them); no arguments
  at all means `{}`. The arguments come back as compact JSON text (OpenAI's `arguments` string),
  re-serialised from the parsed object; NaN and Infinity, which are not JSON, are refused.
- A call that does not parse (malformed JSON, no name, an unknown tool, arguments that are not
  an object) is reported in `problems` with its text and a reason that can be shown to the
  model, and its text stays in the content; the other calls of the completion still count
  (vLLM drops every call when one fails). When no call parses, the whole text is the content,
  unchanged: the caller answers plain text (`finish_reason: "stop"`). Call markup leaves the
  content in three cases, reported in `problems` all the same: a call cut short by max_tokens
  (the last one, still open at the end of the reply: it was never finished), every problem of
  a reply made to be calls only (a forced tool_choice, whose grammar allows nothing else), and a
  call that repeats an earlier one of the reply, name and arguments alike (small models made to
  call a tool repeat their call until the length runs out; the repeat adds nothing).
- HERMES: a last `<tool_call>` without its closing tag counts when a whole JSON object follows
  it and nothing else (generation may stop before the tag, `</tool_call>` as a stop string for
  one); the JSON is read with a JSON decoder, not up to the first `</tool_call>`, so the tag
  inside a string argument does not cut the call.
- LLAMA3_JSON: a call is a JSON object with a `name`, `arguments` or `parameters` key, read
  where a call starts: at the start of the text (after `<|python_tag|>`), after a call and `;`,
  or at `{"name":` (or the other keys) anywhere. vLLM decodes every brace in the text; braces in
  prose are left alone here, so only a call's start is decoded, and text that is not JSON there
  is a malformed call (the rest of the text is left as it is).
- The content is the text outside the calls that parsed (and the markup left out above), with
  the separators between calls (whitespace, `;`) and `<|python_tag|>` dropped, stripped; None
  when nothing is left.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from shared.tools import ToolFormat

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

_TOOLS = re.compile(r"\btools\b")
_SEPARATOR = re.compile(r"[\s;]*")
_LLAMA_SEPARATOR = re.compile(r"\s*;")
_LLAMA_GAP = re.compile(r"(?:\s|;|" + re.escape(PYTHON_TAG) + r")*")
_CALL_KEYS = {"name", "arguments", "parameters"}
_CALL_START = re.compile(r'\{\s*"(?:name|arguments|parameters)"\s*:')
_REPEATS = "repeats call "
_ID_ALPHABET = string.ascii_letters + string.digits
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, compact

    def openai(self, id: str) -> dict[str, Any]:
        """The call in OpenAI's shape (a chat completion message's `tool_calls` item)."""
        return {"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Problem:
    text: str  # the call as the model wrote it
    reason: str
    repeat: bool = False  # a complete call that repeats an earlier one of the reply (left out of the content)

    def __str__(self) -> str:
        return f"{self.reason}: {self.text}"


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ToolCall]
    problems: list[Problem]


def template_family(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template renders, or None: no `tools` in it, or a format this
    module does not read (Mistral's `[TOOL_CALLS]`, Llama 4's `<|python_start|>`...)."""
    if not chat_template or not _TOOLS.search(chat_template):
        return None
    if TOOL_CALL_OPEN in chat_template:
        return ToolFormat.HERMES  # checked first: Hermes templates also show tools' "parameters"
    if PYTHON_TAG in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return ToolFormat.LLAMA3_JSON
    return None


def call_id() -> str:
    """A new tool call id in OpenAI's shape: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


_Found = list[tuple[int, int, ToolCall | Problem]]  # (start, end, what) of each call, in order


def parse_tool_calls(
    text: str, fmt: ToolFormat, tool_names: set[str] | None = None, *, cut: bool = False, forced: bool = False
) -> Parsed:
    """The calls in a completion, the text around them, and the calls that did not parse.
    `cut`: max_tokens ended the reply, so a call still open at its end was cut short. `forced`:
    the reply was made to be calls only (tool_choice "required" or a named function)."""
    found = _hermes(text, tool_names) if fmt is ToolFormat.HERMES else _llama3(text, tool_names)
    found = _without_repeats(found)
    cut_at = len(text)
    last = found[-1] if found else None
    if cut and last is not None and last[1] == len(text) and isinstance(problem := last[2], Problem):
        found[-1] = (last[0], last[1], Problem(problem.text, f"cut short by max_tokens ({problem.reason})"))
        cut_at = last[0]
    calls = [item for _, _, item in found if isinstance(item, ToolCall)]
    problems = [item for _, _, item in found if isinstance(item, Problem)]
    # left out of the content: the calls, repeats, a call cut short, and under a forced choice all
    dropped = [(s, e) for s, e, item in found if not isinstance(item, Problem) or forced or item.repeat or s >= cut_at]
    if not dropped:
        return Parsed(text, [], problems)
    pieces, pos = [], 0
    for start, end in dropped:
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    content = "".join(piece for piece in pieces if not _SEPARATOR.fullmatch(piece))
    if fmt is ToolFormat.LLAMA3_JSON:
        content = content.replace(PYTHON_TAG, "")
    return Parsed(content.strip() or None, calls, problems)


def _without_repeats(found: _Found) -> _Found:
    """Each call that repeats an earlier call of the reply (the same name and arguments) as a
    problem: it adds nothing to the calls, and a small model made to call a tool repeats its call
    until the reply's length runs out."""
    seen: dict[ToolCall, int] = {}
    out: _Found = []
    for start, end, item in found:
        if isinstance(item, ToolCall):
            if item in seen:
                number = seen[item] + 1
                reason = f"{_REPEATS}{number} (the same name and arguments)"
                item = Problem(f"{item.name}({item.arguments})", reason, repeat=True)
            else:
                seen[item] = len(seen)
        out.append((start, end, item))
    return out


def _hermes(text: str, tool_names: set[str] | None) -> _Found:
    found: _Found = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        body = _skip_space(text, start + len(TOOL_CALL_OPEN))
        if not text.startswith("{", body):
            end, _ = _block_end(text, body)
            found.append((start, end, Problem(text[start:end], f"no JSON object after {TOOL_CALL_OPEN}")))
            pos = end
            continue
        try:
            obj, after = _decoder.raw_decode(text, body)
        except (ValueError, RecursionError) as e:
            end, closed = _block_end(text, body)
            reason = f"malformed JSON ({_json_error(e)})" + ("" if closed else f", and no {TOOL_CALL_CLOSE}")
            found.append((start, end, Problem(text[start:end], reason)))
            pos = end
            continue
        after = _skip_space(text, after)
        if text.startswith(TOOL_CALL_CLOSE, after):
            end = after + len(TOOL_CALL_CLOSE)
            found.append((start, end, _call(obj, text[start:end], tool_names)))
        elif after == len(text):  # generation stopped before the closing tag
            end = after
            found.append((start, end, _call(obj, text[start:end], tool_names)))
        else:
            end, _ = _block_end(text, after)
            found.append((start, end, Problem(text[start:end], f"text after the JSON object in {TOOL_CALL_OPEN}")))
        pos = end
    return found


def _llama3(text: str, tool_names: set[str] | None) -> _Found:
    found: _Found = []
    pos = 0
    call_position = _gap_end(text, 0)  # where a call would start: after the tag, a call and `;`
    while (brace := text.find("{", pos)) != -1:
        if brace != call_position and not _CALL_START.match(text, brace):
            pos = brace + 1  # a brace in prose: not decoded, so prose full of braces costs nothing
            continue
        try:
            obj, end = _decoder.raw_decode(text, brace)
        except (ValueError, RecursionError) as e:  # a broken call: the rest of the text is unknown
            found.append((brace, len(text), Problem(text[brace:], f"malformed JSON ({_json_error(e)})")))
            break
        if _CALL_KEYS & obj.keys():  # a JSON value that starts with "{" is an object
            separator = _LLAMA_SEPARATOR.match(text, end)  # the `;` after a call goes with it
            found.append((brace, separator.end() if separator else end, _call(obj, text[brace:end], tool_names)))
            call_position = _gap_end(text, end)
        pos = end
    return found


def _call(obj: Any, raw: str, tool_names: set[str] | None) -> ToolCall | Problem:
    if not isinstance(obj, dict):
        return Problem(raw, f"a call must be a JSON object, not {_json_type(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Problem(raw, 'no "name" (a string) in the call')
    if tool_names is not None and name not in tool_names:
        known = ", ".join(sorted(tool_names)) or "none"
        return Problem(raw, f"unknown tool {name!r} (the request's tools: {known})")
    if "arguments" in obj and "parameters" in obj:
        return Problem(raw, 'both "arguments" and "parameters" in the call')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return Problem(raw, f"the arguments must be a JSON object, not {_json_type(arguments)}")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if math.isinf(value):
        raise ValueError(f"{number} is too large a number")
    return value


_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite)


def _gap_end(text: str, pos: int) -> int:
    gap = _LLAMA_GAP.match(text, pos)
    return gap.end() if gap else pos


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _block_end(text: str, pos: int) -> tuple[int, bool]:
    """Where a `<tool_call>` block that does not parse ends: after its closing tag, before the
    next opening tag, or at the end of the text; and whether it was closed."""
    close = text.find(TOOL_CALL_CLOSE, pos)
    following = text.find(TOOL_CALL_OPEN, pos)
    if following != -1 and (close == -1 or following < close):
        return following, False
    if close == -1:
        return len(text), False
    return close + len(TOOL_CALL_CLOSE), True


def _json_error(error: Exception) -> str:
    return "nested too deeply" if isinstance(error, RecursionError) else str(error)


def _json_type(value: Any) -> str:
    return "a number" if isinstance(value, int | float) and not isinstance(value, bool) else _JSON_TYPES[type(value)]

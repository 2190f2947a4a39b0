"""A conversation with tools as a chat template takes it: the template's own tool support, or,
for a template without any, actq's fallback prompt in the Hermes format.

A template that renders tools (`worker/tool_calls.template_family` finds its format) is given
them as `apply_chat_template(..., tools=...)` expects: each tool in OpenAI's shape, past calls
with their arguments as objects (templates apply `tojson` to them: a JSON string would be quoted
twice), and each tool result with the `name` of the function it answers (templates that show it).

A template without tool support (the built-in SmolLM2's, most base chat templates) gets the
tools as text, in the format most open models are trained on (Hermes; Qwen 2.5 writes the same
tags), using only the roles every template knows:

- the tools are described at the end of the system message (one is added first if the
  conversation has none), as JSON within `<tools></tools>`, with how to call them;
- a past assistant call is written into that turn's content as `<tool_call>` JSON `</tool_call>`,
  which is what the model is asked to write and what `parse_tool_calls` reads back;
- tool results are a user turn: each within `<tool_response></tool_response>`, consecutive
  results in one turn.

Why a fallback rather than a 4xx: it lets the models without tool templates that researchers
study (the built-in model first) run the with-tools loop and be compared with their no-tools
runs; a model that never learned the format answers in plain text, which comes back as content.
"""

from __future__ import annotations

import json
from typing import Any

from shared.schemas import ChatMessage
from shared.tools import Tool

FALLBACK_INTRO = (
    "You can call functions to help with the request. The functions you may call are described "
    "below as JSON Schema, within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments within "
    "<tool_call></tool_call> tags, one call per block:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>\n'
    "Each result comes back within <tool_response></tool_response> tags."
)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a tool-aware template takes them."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.argument_values()},
                }
                for call in message.tool_calls
            ]
            names.update({call.id: call.function.name for call in message.tool_calls})
        if message.role == "tool":
            entry["tool_call_id"] = message.tool_call_id
            entry["name"] = names.get(message.tool_call_id or "", "")
        out.append(entry)
    return out


def fallback_messages(messages: list[ChatMessage], tools: list[Tool] | None) -> list[dict[str, Any]]:
    """The messages with the tools written into them, in roles system, user and assistant only."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.text}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
            continue
        content = message.text
        if message.tool_calls:
            calls = [
                "<tool_call>\n"
                + json.dumps({"name": call.function.name, "arguments": call.function.argument_values()})
                + "\n</tool_call>"
                for call in message.tool_calls
            ]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": message.role, "content": content})
    if tools:
        intro = FALLBACK_INTRO.format(tools="\n".join(json.dumps(t.rendered()) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{intro}" if out[0]["content"] else intro
        else:
            out.insert(0, {"role": "system", "content": intro})
    return [{"role": m["role"], "content": m["content"]} for m in out]

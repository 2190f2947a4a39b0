"""vLLM's request extras through the official openai client (`extra_body`), on the stack's tiny
model: the constraints of `structured_outputs` and its deprecated `guided_*` names shape the reply
(constrained decoding: a random model writes only what the grammar allows), chat `echo` puts the
last message before the reply as vLLM does, streamed or not, and `min_tokens` holds off stop
strings as vLLM's engine does."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.support.stack import TINY

MESSAGES = [{"role": "user", "content": "Pick a colour, then tell me why."}]
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["colour", "n"],
}


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def chat(client, max_tokens: int = 24, **extra):
    return client.chat.completions.create(
        model=TINY, messages=extra.pop("messages", MESSAGES), max_tokens=max_tokens, temperature=0, extra_body=extra
    )


def streamed(client, max_tokens: int = 24, **extra) -> str:
    stream = client.chat.completions.create(
        model=TINY,
        messages=extra.pop("messages", MESSAGES),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    return "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)


@pytest.mark.parametrize(
    ("extra", "holds"),
    [
        ({"guided_choice": ["crimson red", "sky blue"]}, lambda t: t in ("crimson red", "sky blue")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"[a-c]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        ({"structured_outputs": {"regex": r"(up|down) [0-9]"}}, lambda t: re.fullmatch(r"(up|down) [0-9]", t)),
        ({"guided_grammar": 'start: "go " dir\ndir: "left" | "right"\n'}, lambda t: t in ("go left", "go right")),
        ({"guided_json": SCHEMA}, lambda t: valid(t, SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: valid(t, SCHEMA)),
    ],
    ids=["guided-choice", "choice", "guided-regex", "regex", "guided-grammar", "guided-json", "json-text"],
)
def test_the_reply_follows_the_constraint(client, extra, holds):
    free = chat(client).choices[0].message.content
    reply = chat(client, **extra).choices[0]
    assert holds(reply.message.content), (reply.message.content, free)
    assert reply.finish_reason == "stop"  # the grammar was complete: the reply ended there
    assert not holds(free)  # unconstrained, the random model writes something else


def test_chat_echo_puts_the_last_message_first_when_its_role_is_the_replys(client):
    """vLLM: with the assistant's turn opened (the default), only a final assistant message is
    echoed; with `add_generation_prompt: false` the reply's role is the last message's, so it is
    echoed whatever it is. Streamed, the echo comes first and the pieces join into the same text."""
    plain = chat(client, 8).choices[0].message.content
    assert chat(client, 8, echo=True).choices[0].message.content == plain  # a user message: not the reply's role
    prefill = [*MESSAGES, {"role": "assistant", "content": "My colour is"}]
    continued = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    bare = chat(client, 8, **continued).choices[0].message.content
    echoed = chat(client, 8, echo=True, **continued).choices[0].message.content
    assert echoed == "My colour is" + bare
    assert streamed(client, 8, echo=True, **continued) == echoed
    user_continued = {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False}
    own = chat(client, 8, **user_continued).choices[0].message.content
    assert chat(client, 8, echo=True, **user_continued).choices[0].message.content == MESSAGES[0]["content"] + own


def test_min_tokens_holds_off_a_stop_string_streamed_or_not(client):
    """A stop string in the reply's first token does not end it before min_tokens tokens (it did
    before issue 47's fix: one token, the text cut to nothing); the streamed pieces join into the
    same text."""
    free = chat(client, 12, min_tokens=6)
    stop = free.choices[0].message.content.strip()[0]
    early = chat(client, 12, stop=[stop])
    held = chat(client, 12, stop=[stop], min_tokens=6)
    assert early.usage.completion_tokens < 6
    assert held.usage.completion_tokens > 6 and stop in held.choices[0].message.content
    assert free.choices[0].message.content.startswith(held.choices[0].message.content)
    assert streamed(client, 12, stop=[stop], min_tokens=6) == held.choices[0].message.content

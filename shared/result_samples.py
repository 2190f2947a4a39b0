"""What a sample of a results directory (`actq gsm8k`, `actq run-file`; or a job `actq export
--jobs` picks) holds: its sources (its generation, a tool run's turns, its traces) that have
activations, and its prompt's text. Read by `actq export` (shared/cli/export*.py) and the
activations reader (shared/activations.py)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

GENERATED = "generated"


def sources(sample: dict, skipped: Counter, turns: str = "all") -> Iterator[tuple[str, dict]]:
    """(source name, fields) for each source of a sample that has activations to export; counts
    the others in `skipped` under "<source>: <reason>". A sample that never generated (a run of
    traces only: no job_id) has no "generated" source at all; a tool run's has one per turn that
    `turns` picks."""
    correct = sample.get("correct")
    text = sample.get("completion", sample.get("text"))  # gsm8k: completion; run-file: text
    if sample.get("mode") == "trace":  # a prompt file's trace line generated nothing: what it scored
        text = _traced_reply(sample)
    generation = {
        "job_id": sample.get("job_id"),
        "status": sample.get("status"),
        "text": text,
        "correct": correct.get("flexible") if isinstance(correct, dict) else None,
        "prompt_tokens": sample.get("prompt_tokens"),
        "completion_span": sample.get("completion_span"),  # a run-file trace line's
        "activations": sample.get("activations"),
        "activations_file": sample.get("activations_file"),
    }
    candidates: list[tuple[str, dict]] = []
    turn_jobs = sample.get("turn_jobs")
    if turn_jobs:
        picked = turn_jobs if turns == "all" else turn_jobs[:1] if turns == "first" else turn_jobs[-1:]
        candidates += [(GENERATED, {**generation, **job}) for job in picked]
    elif generation["job_id"] is not None or generation["activations"]:
        candidates.append((GENERATED, generation))
    for name, trace in (sample.get("traces") or {}).items():
        if isinstance(trace, dict):
            candidates.append((str(name), trace))
    for name, fields in candidates:
        if fields.get("status") != "succeeded":
            skipped[f"{name}: {fields.get('status') or 'no status'}"] += 1
        elif not (fields.get("activations") or {}).get("tensors"):
            skipped[f"{name}: no activations"] += 1
        else:
            yield name, fields


def _traced_reply(sample: dict) -> str | None:
    messages = sample.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        if messages[-1].get("role") == "assistant":
            return _content_text(messages[-1].get("content"))
    return None


def _content_text(content: Any) -> str | None:
    """A message's text: its string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts) if parts else None
    return None


def prompt_of(sample: dict) -> tuple[str | None, str | None]:
    """(prompt, messages as JSON) of a sample: a prompt line's prompt, a messages line's last user
    message (and the whole conversation), a GSM8K problem's question."""
    if isinstance(sample.get("prompt"), str):
        return sample["prompt"], None
    messages = sample.get("messages")
    if isinstance(messages, list):
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        prompt = _content_text(users[-1].get("content")) if users else None
        return prompt, json.dumps(messages, ensure_ascii=False, allow_nan=False)
    question = sample.get("question")
    return (question if isinstance(question, str) else None), None


def reply_start(fields: dict) -> int | None:
    """The position where a source's reply starts: a trace's traced reply (its completion span;
    a trace's prompt_tokens count the whole text), else the generated tokens (after the prompt)."""
    span = fields.get("completion_span")
    if isinstance(span, list | tuple) and span:
        return int(span[0])
    prompt = fields.get("prompt_tokens")
    return prompt if isinstance(prompt, int) else None

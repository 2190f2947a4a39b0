"""Succeeded jobs as OpenAI's ChatCompletion and Completion: choices, usage, log-probabilities in
OpenAI's two shapes (`chat_logprobs`, `legacy_logprobs`) and vLLM's `prompt_logprobs`, all from the
job's `result.logprobs`, and the `actq` field.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from anyio import to_thread
from fastapi import Request

from api.openai.errors import OpenAIError
from api.openai.protocol import (
    ActqExtra,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    ChatTokenLogprob,
    ChatTopLogprob,
    Choice,
    ChoiceExtra,
    ChoiceLogprobs,
    Completion,
    CompletionLogprobs,
    CompletionRequest,
    PromptLogprob,
    PromptLogprobs,
    TextChoice,
)
from api.openai.requests import echoed
from api.presenters import view
from shared.schemas import (
    JobRecord,
    JobResult,
    Logprobs,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:
    from shared.jobs import JobStore


@dataclass(frozen=True)
class Shown:
    """What a request asked to see of its jobs' log-probabilities (a job may hold more: one job
    serves a request's `logprobs` and `prompt_logprobs` with the larger count of alternatives)."""

    generated: bool = False  # `choices[].logprobs` (legacy with `echo`: the prompt's entries first)
    top: int = 0  # the likeliest alternatives shown per token there
    prompt: int | None = None  # vLLM's `prompt_logprobs`: each prompt token's, with this many alternatives
    echo: bool = False  # legacy `echo`: the text (and the logprobs) begin with the prompt
    as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`
    chat_echo: str = ""  # vLLM's chat `echo`: the text before each choice's content (api/openai/requests.py)

    @classmethod
    def of(cls, body: ChatCompletionRequest | CompletionRequest) -> Shown:
        as_ids = bool(body.return_tokens_as_token_ids)
        if isinstance(body, ChatCompletionRequest):
            top = (body.top_logprobs or 0) if body.logprobs else 0
            return cls(bool(body.logprobs), top, body.prompt_logprobs, as_ids=as_ids, chat_echo=echoed(body))
        generated = body.logprobs is not None
        return cls(generated, body.logprobs or 0, body.prompt_logprobs, echo=bool(body.echo), as_ids=as_ids)


def _choice_extra(record: JobRecord, request: Request) -> ChoiceExtra:
    """A job's part of the `actq` field: its manifest as GET /jobs/{id} renders it (download_url included)."""
    result = record.result
    return ChoiceExtra(
        job_id=record.id,
        activations=view(record, request).activations,
        interventions=result.interventions if result is not None else None,
        baseline=result.baseline if result is not None else None,
    )


def _extra(records: list[JobRecord], request: Request) -> ActqExtra:
    """The `actq` field: the first job's manifest, and with several choices every job's."""
    extras = [_choice_extra(record, request) for record in records]
    return ActqExtra(**extras[0].model_dump(), choices=extras if len(extras) > 1 else None)


def _usage(records: list[JobRecord]) -> Usage:
    """Tokens over every choice, each prompt counted once (as OpenAI counts `n` choices)."""
    prompts: dict[tuple, int] = {}
    completion = 0
    for record in records:
        assert record.result is not None
        request = record.request
        key = (request.prompt, tuple(request.prompt_token_ids or ()), request.model_dump_json(include={"messages"}))
        prompts[key] = record.result.usage.prompt_tokens
        completion += record.result.usage.completion_tokens
    prompt = sum(prompts.values())
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


LOGPROB_FLOOR = -9999.0  # what OpenAI (and vLLM) answer for a token with no probability at all


def _openai_logprob(value: float | None) -> float:
    """A log-probability JSON can carry: -inf (a token the model rules out; a result read back from
    Redis holds it as null) and anything below the floor become LOGPROB_FLOOR, as OpenAI answers."""
    if value is None or value != value:  # None or NaN
        return LOGPROB_FLOOR
    return max(value, LOGPROB_FLOOR)


async def whole_result(jobs: JobStore, record: JobRecord) -> JobRecord:
    """The record with its whole result: a result stored apart from the record (its text past the
    first characters, its log-probability entries) is read from its own key and parsed on a thread."""
    result = record.result
    if result is None or result.stored is None:
        return record
    raw = await jobs.stored_result_async(record.id)
    if raw is None:
        raise OpenAIError(
            404, f"job {record.id} succeeded, but its result is no longer stored", "job_not_found", job_id=record.id
        )
    whole = await to_thread.run_sync(functools.partial(JobResult.model_validate_json, raw, extra="ignore"))
    return record.model_copy(update={"result": whole})


def _inline_logprobs(record: JobRecord) -> Logprobs | None:
    """The job's log-probabilities when its request asked for them; a 400 naming the job when there
    were too many to hold inline (they are in its activations file instead)."""
    result = record.result
    if result is None or not record.request.logprobs or result.logprobs is None:
        return None
    if result.logprobs.content is None:
        request, usage = record.request, result.usage
        prompt = usage.prompt_tokens - 1 if request.trace or request.prompt_logprobs else 0  # the first has none
        tokens = prompt + (0 if request.trace else usage.completion_tokens)
        raise OpenAIError(
            400,
            f"job {record.id} succeeded, but its {tokens} tokens of log-probabilities are more than a response "
            f"holds (the worker's ACTQ_LOGPROBS_INLINE_TOKENS): read them from its activations file, GET "
            f"/jobs/{record.id}/activations (tensors logprobs, logprob_token_ids, top_logprobs, top_logprob_ids), "
            "or raise ACTQ_LOGPROBS_INLINE_TOKENS",
            "logprobs_too_long",
            param="logprobs",
            job_id=record.id,
            retry=False,
        )
    return result.logprobs


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _shown(token: str, token_id: int, as_ids: bool) -> str:
    """A token as a logprob entry names it: its text, or with vLLM's `return_tokens_as_token_ids`
    `token_id:<id>` (a piece of a multi-byte character, whose text is U+FFFD, stays identifiable)."""
    return f"token_id:{token_id}" if as_ids else token


def chat_logprobs(record: JobRecord, shown: Shown) -> ChoiceLogprobs | None:
    """The job's generated tokens' log-probabilities in OpenAI's ChatCompletion shape (None when
    not asked for). A token is its text decoded alone, so a piece of a multi-byte character is
    U+FFFD, and `bytes` are that text's UTF-8 bytes (the token ids are in GET /jobs/{id})."""
    logprobs = _inline_logprobs(record) if shown.generated else None
    if logprobs is None:
        return None
    as_ids = shown.as_ids
    return ChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=_shown(entry.token, entry.token_id, as_ids),
                logprob=_openai_logprob(entry.logprob),
                bytes=_utf8(_shown(entry.token, entry.token_id, as_ids)),
                top_logprobs=[
                    ChatTopLogprob(
                        token=_shown(top.token, top.token_id, as_ids),
                        logprob=_openai_logprob(top.logprob),
                        bytes=_utf8(_shown(top.token, top.token_id, as_ids)),
                    )
                    for top in entry.top_logprobs[: shown.top]
                ],
            )
            for entry in _parts(record, logprobs)[1]
        ]
    )


def _parts(record: JobRecord, logprobs: Logprobs) -> tuple[list[TokenLogprob], list[TokenLogprob]]:
    """A job's log-probability entries split into its prompt's (a trace: all of them; a job with
    `prompt_logprobs`: the first `prompt_entries`) and its generated tokens'."""
    entries = logprobs.content or []
    if record.request.trace:
        return entries, []
    if record.request.prompt_logprobs:
        prompt = logprobs.prompt_entries or 0
        return entries[:prompt], entries[prompt:]
    return [], entries


def legacy_logprobs(record: JobRecord, shown: Shown) -> CompletionLogprobs | None:
    """The job's log-probabilities in OpenAI's legacy Completion shape (None when not asked for):
    generated tokens, or with echo every token of the prompt first (then the generated ones), the
    prompt's first with no log-probability (None, and None in `top_logprobs`). `top_logprobs[i]`
    maps the k likeliest tokens' texts to their log-probabilities (tokens that decode to the same
    text share one key). `text_offset[i]` is where token i starts in the returned text, counted
    over the tokens' texts before it: exact when the tokens' texts join into the text, which they
    do but for a BOS the tokenizer adds (its text, e.g. "<s>", is not in the prompt), a character
    split across tokens (each piece is U+FFFD), and tokens past a stop string (the text ends before
    the stop string, the tokens go on to the last one generated)."""
    logprobs = _inline_logprobs(record) if shown.generated else None
    if logprobs is None:
        return None
    prompt, generated = _parts(record, logprobs)
    entries = prompt + generated if shown.echo else generated
    first_unscored = bool(shown.echo and prompt)
    as_ids = shown.as_ids
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    values: list[float | None] = [
        None if first_unscored and i == 0 else _openai_logprob(entry.logprob) for i, entry in enumerate(entries)
    ]
    top: list[dict[str, float] | None] | None = None
    if shown.top:
        top = [
            None
            if first_unscored and i == 0
            else {
                _shown(t.token, t.token_id, as_ids): _openai_logprob(t.logprob) for t in entry.top_logprobs[: shown.top]
            }
            for i, entry in enumerate(entries)
        ]
    return CompletionLogprobs(
        tokens=[_shown(entry.token, entry.token_id, as_ids) for entry in entries],
        token_logprobs=values,
        top_logprobs=top,
        text_offset=offsets,
    )


def prompt_logprobs(record: JobRecord, shown: Shown) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` (None when not asked for): per prompt token, None for the first
    (nothing predicts it), then a map from token id to its log-probability, rank and text: the
    prompt's own token first, then the `shown.prompt` likeliest (ranks 1 to k; one entry when the
    prompt's token is among them)."""
    logprobs = _inline_logprobs(record) if shown.prompt is not None else None
    if logprobs is None or shown.prompt is None:
        return None
    shown_prompt: PromptLogprobs = []
    for entry in _parts(record, logprobs)[0]:
        if entry.logprob is None:
            shown_prompt.append(None)
            continue
        place = {
            str(entry.token_id): PromptLogprob(
                logprob=_openai_logprob(entry.logprob),
                rank=entry.rank,
                decoded_token=_shown(entry.token, entry.token_id, shown.as_ids),
            )
        }
        for rank, top in enumerate(entry.top_logprobs[: shown.prompt], start=1):
            place.setdefault(
                str(top.token_id),
                PromptLogprob(
                    logprob=_openai_logprob(top.logprob),
                    rank=rank,
                    decoded_token=_shown(top.token, top.token_id, shown.as_ids),
                ),
            )
        shown_prompt.append(place)
    return shown_prompt


def _first_id(records: list[JobRecord]) -> str:
    return records[0].id


def completion(records: list[JobRecord], request: Request, shown: Shown) -> ChatCompletion:
    """Succeeded jobs, one per choice, as OpenAI's ChatCompletion; vLLM's `prompt_logprobs` (one
    prompt for every choice) from the first."""
    choices = []
    for index, record in enumerate(records):
        assert record.result is not None
        message = AssistantMessage.of(record.result)
        if shown.chat_echo:
            message.content = shown.chat_echo + (message.content or "")
        choices.append(
            Choice(
                index=index,
                message=message,
                finish_reason=record.result.finish_reason,
                logprobs=chat_logprobs(record, shown),
            )
        )
    return ChatCompletion(
        id=f"chatcmpl-{_first_id(records)}",
        created=int(records[0].created_at.timestamp()),
        model=records[0].model,
        choices=choices,
        usage=_usage(records),
        actq=_extra(records, request),
        prompt_logprobs=prompt_logprobs(records[0], shown),
    )


def _prompt_text(record: JobRecord) -> str:
    """The prompt as text, for echo: as sent, or for token ids their entries' texts joined (an
    echo of token ids always scores its prompt, see `completion_job_requests`)."""
    if record.request.prompt is not None:
        return record.request.prompt
    result = record.result
    assert result is not None and result.logprobs is not None
    logprobs = _inline_logprobs(record)
    entries = (logprobs.content or []) if logprobs is not None else []
    prompt = result.usage.prompt_tokens
    return "".join(entry.token for entry in entries[:prompt])


def _text_choice(index: int, record: JobRecord, shown: Shown) -> TextChoice:
    result = record.result
    assert result is not None
    text = _prompt_text(record) + result.text if shown.echo else result.text
    return TextChoice(
        text=text,
        index=index,
        finish_reason=result.finish_reason,
        logprobs=legacy_logprobs(record, shown),
        prompt_logprobs=prompt_logprobs(record, shown),
    )


def text_completion(records: list[JobRecord], request: Request, shown: Shown) -> Completion:
    """Succeeded jobs, one per choice, as OpenAI's Completion (finish_reason as for chat: a
    succeeded job stopped or ran to its length; cancelled and timed-out jobs are errors, see
    `unfinished`). With `echo` the text begins with the prompt; a trace job (echo with max_tokens
    0) answers its prompt alone, with finish_reason "length" (as OpenAI: the 0 tokens asked for were
    generated). `shown`: which log-probabilities the request asked for (an echo of token ids scores
    its prompt without being asked, for the prompt's text)."""
    return Completion(
        id=f"cmpl-{_first_id(records)}",
        created=int(records[0].created_at.timestamp()),
        model=records[0].model,
        choices=[_text_choice(i, record, shown) for i, record in enumerate(records)],
        usage=_usage(records),
        actq=_extra(records, request),
    )

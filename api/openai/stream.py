"""`stream: true` on `POST /v1/chat/completions` and `POST /v1/completions`: the jobs' text as
server-sent events in OpenAI's chunk format, as the worker generates it.

The request becomes the same jobs as without `stream` (one per choice: prompts x `n`, with
`stream: true` on each, so the worker publishes its text as it grows: worker/engine/progress.py,
`keys.job_text`), submitted the same way (api/openai/submit.py) and holding one of the process's
long-poll places for as long as the stream is open. Before the first byte, a bad request, an
unknown model or a full queue is an ordinary 4xx JSON answer in OpenAI's error shape; after it, an
error is an event `{"error": {...}}` in the same shape (the openai SDK raises APIError on it), then
`[DONE]`.

The events: every chunk holds one choice, named by its `index` (prompt i's choice j is index
i * n + j, as in the non-streamed answer), and the choices' chunks interleave as their jobs
generate, as OpenAI's do. Chat answers `chat.completion.chunk` objects (first, for each choice, a
chunk with the assistant's role, then `delta.content` pieces); the legacy completion answers
`text_completion` objects (`text` pieces). Once a choice's job has finished: a last piece with
whatever part of its final text (exactly the non-streamed answer's text) the pieces did not hold
yet, so that each choice's pieces always join into that text; its tool calls, if any; then a chunk
with an empty delta, its finish reason and, if asked, its log-probabilities. With
`stream_options.include_usage`, after every choice has finished, a chunk with empty `choices` and
the whole request's `usage` (and `usage: null` on every other chunk). The last chunk before
`data: [DONE]` carries `actq`, as in the non-streamed answer (the job ids and activations
manifests), plus `live`: whether every choice's text came as it was generated. The
`x-actq-job-id` header names the jobs, in choice order.

A stream that cannot be served live says so in a comment line (`: actq: not streamed live: ...`)
and with `actq.live: false`, and sends each choice's whole text in one piece once its job has
finished: an Idempotency-Key replay of a job already finished, or of one submitted without
`stream`; a scoring job (`echo` with `max_tokens: 0`), `echo` with generation (the prompt comes
with the text), and a reply that may call tools. A client that goes away does not cancel the jobs:
they run to their end, activations and all (DELETE /jobs/{id} cancels one).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import redis
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from api.bodies import in_turn, is_large
from api.deps import Services
from api.errors import redis_trouble
from api.job_text import JobTexts, TextFeed
from api.openai.errors import JOB_ID_HEADER, OpenAIError
from api.openai.protocol import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from api.openai.requests import completion_job_requests, to_job_requests
from api.openai.responses import Shown, completion, text_completion
from api.openai.submit import Queued, result, submit_and_wait
from api.run_labels import labelled
from shared.schemas import JobRecord, JobRequest

log = logging.getLogger("actq.api")
KEEPALIVE_SECONDS = 15.0  # a comment line when nothing else was sent for this long (proxies drop idle streams)
STREAM_OPTIONS = ("include_usage", "include_obfuscation")

Render = Callable[[list[JobRecord], Request], ChatCompletion | Completion]


def _options(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """`stream_options`, checked: whether to add the usage chunk (`include_usage`).
    `include_obfuscation` is accepted and has no effect (no padding is added to the chunks)."""
    options = body.stream_options
    if options is None:
        return False
    if not body.stream:
        raise OpenAIError(
            400,
            "stream_options is only allowed with stream=true; leave it out, or send stream=true",
            "invalid_request",
            param="stream_options",
        )
    if not isinstance(options, dict):
        raise OpenAIError(
            400,
            f"stream_options must be an object such as {{'include_usage': true}}, not {json.dumps(options)[:60]}",
            "invalid_request",
            param="stream_options",
        )
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise OpenAIError(
                400,
                f"stream_options.{key} is not supported; stream_options takes {' and '.join(STREAM_OPTIONS)}",
                "unsupported_parameter",
                param=f"stream_options.{key}",
            )
        if value is not None and not isinstance(value, bool):
            raise OpenAIError(
                400,
                f"stream_options.{key} must be true or false, not {json.dumps(value)[:60]}",
                "invalid_request",
                param=f"stream_options.{key}",
            )
    return bool(options.get("include_usage"))


async def stream_chat(
    services: Services, body: ChatCompletionRequest, request: Request, caller: str | None, key: str | None
) -> StreamingResponse:
    """POST /v1/chat/completions with `stream: true` (or with `stream_options`, refused without it)."""
    usage = _options(body)
    job_requests = labelled(request, await in_turn(request, services, caller, to_job_requests, body))

    def render(records: list[JobRecord], request: Request) -> ChatCompletion:
        return completion(records, request, Shown.of(body))

    fmt = _Format(chat=True, usage=usage, echo=Shown.of(body).chat_echo)
    return await _open(services, job_requests, fmt, render, request, caller, key, body)


async def stream_completion(
    services: Services, body: CompletionRequest, request: Request, caller: str | None, key: str | None
) -> StreamingResponse:
    """POST /v1/completions with `stream: true` (or with `stream_options`, refused without it)."""
    usage = _options(body)
    job_requests = labelled(request, await in_turn(request, services, caller, completion_job_requests, body))

    def render(records: list[JobRecord], request: Request) -> Completion:
        return text_completion(records, request, Shown.of(body))

    fmt = _Format(chat=False, usage=usage)
    if body.echo:
        fmt.not_live = (
            "a scoring job (echo with max_tokens 0) generates no text step by step"
            if job_requests[0].trace
            else "echo=true: the prompt comes with its completion"
        )
    return await _open(services, job_requests, fmt, render, request, caller, key, body)


@dataclass
class _Format:
    """What the chunks of one stream look like."""

    chat: bool
    usage: bool  # stream_options.include_usage
    not_live: str | None = None  # why no choice's text can come as it is generated
    echo: str = ""  # vLLM's chat `echo`: sent first in each choice, before its generated text
    id: str = ""
    created: int = 0
    model: str = ""

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.chat:
            body["system_fingerprint"] = None
        if self.usage:
            body["usage"] = None
        body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def choice(self, index: int, text: str, finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}

    def piece(self, index: int, text: str) -> str:
        return self.chunk([self.choice(index, text)])


@dataclass(eq=False)
class _Choice:
    """One choice of the stream: its job (with the wait for its end), the live text feed (None:
    not live, or no longer), and the text sent so far."""

    index: int
    job: Queued
    feed: TextFeed | None = None
    not_live: str | None = None
    text: str = ""  # the live text read so far (pieces must follow on from it)
    sent: str = ""
    record: JobRecord | None = None  # once finished, its whole result

    @property
    def live(self) -> bool:
        return self.not_live is None

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def done(self) -> asyncio.Future[JobRecord | None]:
        return self.job.done


def _error(exc: OpenAIError) -> str:
    error: dict[str, Any] = {
        "message": exc.message,
        "type": "invalid_request_error" if exc.status < 500 else "server_error",
    }
    error.update(param=exc.param, code=exc.code)
    if exc.job_id is not None:
        error["job_id"] = exc.job_id
    return f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """A StreamingResponse that always lets go of what the stream holds (its long-poll place, its
    feed, its wait), even when the client left before the first event."""

    def __init__(self, content: AsyncIterator[str], held: AsyncExitStack, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.held = held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.held.aclose()


def _texts(request: Request, services: Services) -> JobTexts:
    """The process's one reader of streamed jobs' text (made on first use)."""
    texts = getattr(request.app.state, "job_texts", None)
    if texts is None:
        texts = request.app.state.job_texts = JobTexts(services.aredis)
    return texts


async def _open(
    services: Services,
    job_requests: list[JobRequest],
    fmt: _Format,
    render: Render,
    request: Request,
    caller: str | None,
    key: str | None,
    body: ChatCompletionRequest | CompletionRequest,
) -> StreamingResponse:
    """Submit the jobs as the answered routes do (api/openai/submit.py: the long-poll place first,
    held for as long as the stream is open), open the live ones' text feeds, and answer the stream
    of their events."""
    if any(r.parses_tool_calls for r in job_requests):
        fmt.not_live = "a reply that may call tools comes whole: its calls are read from the finished text"
    job_requests = [r.model_copy(update={"stream": fmt.not_live is None}) for r in job_requests]
    held = AsyncExitStack()
    try:
        queued = await submit_and_wait(
            services,
            held,
            job_requests,
            large=await is_large(request),
            wait_seconds=body.actq_wait_seconds,
            idempotency_key=key,
            caller=caller,
        )
        first = queued[0].record
        fmt.id, fmt.created, fmt.model = first.id, int(first.created_at.timestamp()), first.model
        choices = []
        for index, job in enumerate(queued):
            choice = _Choice(index, job, not_live=fmt.not_live)
            if not job.created and job.record.status.terminal:
                choice.not_live = "the job had already finished (an Idempotency-Key replay)"
            elif not job.created and not job.record.request.stream:
                choice.not_live = "the job (an Idempotency-Key replay) was submitted without stream"
            if choice.live:
                texts = _texts(request, services)
                choice.feed = texts.open(job.job_id)
                held.callback(texts.close, choice.feed)
            choices.append(choice)
    except BaseException:
        await held.aclose()
        raise
    events = _events(services, fmt, render, request, choices, body.actq_wait_seconds, key)
    headers = {
        JOB_ID_HEADER: ",".join(choice.job_id for choice in choices),
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    }
    return _EventStream(events, held, headers)


async def _events(
    services: Services,
    fmt: _Format,
    render: Render,
    request: Request,
    choices: list[_Choice],
    waited: float,
    key: str | None,
) -> AsyncIterator[str]:
    if fmt.chat:  # as OpenAI: each choice's role first, with empty content
        for choice in choices:
            first = {"role": "assistant", "content": ""}
            yield fmt.chunk([{"index": choice.index, "delta": first, "logprobs": None, "finish_reason": None}])
            if fmt.echo:
                yield fmt.piece(choice.index, fmt.echo)
    reasons = dict.fromkeys(choice.not_live for choice in choices if choice.not_live is not None)
    for reason in reasons:
        yield f": actq: not streamed live: {reason}; the whole text comes when the job has finished\n\n"
    open_ = list(choices)
    try:
        while open_:
            readies = [asyncio.ensure_future(c.feed.ready.wait()) for c in open_ if c.feed is not None]
            waits: set[asyncio.Future[Any]] = {*readies, *(c.done for c in open_)}
            try:
                finished, _ = await asyncio.wait(waits, timeout=KEEPALIVE_SECONDS, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for ready in readies:
                    ready.cancel()
            if not finished:
                yield ": keep-alive\n\n"
                continue
            for choice in list(open_):
                if not choice.done.done():
                    piece = _grown(choice)
                    if piece:
                        yield fmt.piece(choice.index, piece)
                    continue
                open_.remove(choice)
                choice.record = await result(services, choice.job, waited, key)
                whole = None
                if not open_:  # the last choice: the whole answer's usage and `actq` come with it
                    whole = render([c.record for c in choices if c.record is not None], request)
                async for event in _ending(fmt, choice, render([choice.record], request), whole, reasons):
                    yield event
    except OpenAIError as exc:
        yield _error(exc)
    except redis.RedisError as exc:
        job_ids = ",".join(choice.job_id for choice in choices)
        yield _error(OpenAIError(503, redis_trouble(exc), "service_unavailable", job_id=job_ids))
    except Exception:  # the stream has started: an error event, never a broken stream
        job_ids = ",".join(choice.job_id for choice in choices)
        log.exception("streaming jobs %s failed", job_ids)
        yield _error(OpenAIError(500, f"streaming jobs {job_ids} failed; GET /jobs/{{id}} has each", "internal_error"))
    yield "data: [DONE]\n\n"


def _grown(choice: _Choice) -> str:
    """The new part of a live choice's text. Pieces that do not follow on from the text so far
    (entries trimmed or lost, a job run again after a lost worker) end its live text: the rest
    comes from the final text."""
    feed = choice.feed
    if feed is None:
        return ""
    text = choice.text
    for entry in feed.take():
        if entry is None:  # the job left the engine: its record says the rest
            choice.feed = None
            break
        at, piece = entry
        overlap = min(len(text) - at, len(piece))  # what this entry repeats of the text so far
        if at > len(text) or text[at : at + overlap] != piece[:overlap]:
            choice.feed = None  # a gap, or text that differs: no more live pieces
            break
        if at + len(piece) > len(text):
            text = text[:at] + piece
    choice.text = text
    piece = text[len(choice.sent) :] if text.startswith(choice.sent) else ""
    choice.sent = text if piece else choice.sent
    return piece


async def _ending(
    fmt: _Format,
    choice: _Choice,
    answer: ChatCompletion | Completion,
    whole: ChatCompletion | Completion | None,
    reasons: dict[str, None],
) -> AsyncIterator[str]:
    """A finished choice: the rest of its final text, its tool calls, its finish chunk; after the
    last choice (`whole`: the answer of every choice), the usage chunk and `actq` on the last."""
    logprobs: BaseModel | None
    calls: list[dict[str, Any]] = []
    if isinstance(answer, ChatCompletion):
        chat = answer.choices[0]
        text, reason, logprobs = chat.message.content or "", chat.finish_reason, chat.logprobs
        calls = [{"index": i, **call.model_dump(mode="json")} for i, call in enumerate(chat.message.tool_calls or [])]
    else:
        legacy = answer.choices[0]
        text, reason, logprobs = legacy.text, legacy.finish_reason, legacy.logprobs
    sent = fmt.echo + choice.sent  # the echo was sent first (chat `echo`), then the live pieces
    if not text.startswith(sent):
        log.warning("job %s: its streamed text is not a prefix of its final text", choice.job_id)
    if text[len(sent) :]:
        yield fmt.piece(choice.index, text[len(sent) :])
    if calls:  # each call whole, in one delta (as OpenAI's chunks, which split the arguments)
        delta = {"tool_calls": calls}
        yield fmt.chunk([{"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}])
    shown = logprobs.model_dump(mode="json") if logprobs is not None else None
    finish = fmt.choice(choice.index, "", reason, shown)
    if whole is None:
        yield fmt.chunk([finish])
        return
    actq = {**whole.actq.model_dump(mode="json"), "live": not reasons}
    if reasons:
        actq["not_live"] = next(iter(reasons))
    if not fmt.usage:
        yield fmt.chunk([finish], actq=actq)
        return
    yield fmt.chunk([finish])
    yield fmt.chunk([], usage=whole.usage.model_dump(mode="json"), actq=actq)

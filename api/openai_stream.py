"""`stream: true` on `POST /v1/chat/completions` and `POST /v1/completions`: the job's text as
server-sent events in OpenAI's chunk format, as the worker generates it.

The request becomes the same job as without `stream` (with `stream: true` on it, so the worker
publishes its text as it grows: worker/progress.py, `keys.job_text`), submitted the same way and
holding one of the process's long-poll places for as long as the stream is open. Before the first
byte, a bad request, an unknown model or a full queue is an ordinary 4xx JSON answer in OpenAI's
error shape; after it, an error is an event `{"error": {...}}` in the same shape (the openai SDK
raises APIError on it), then `[DONE]`.

The events: chat answers `chat.completion.chunk` objects (a first chunk with the assistant's role,
then `choices[0].delta.content` pieces); the legacy completion answers `text_completion` objects
(`choices[0].text` pieces). Once the job has finished, a last piece with whatever part of the
job's final text (exactly the non-streamed answer's text) the pieces did not hold yet, so the
pieces always join into that text; then a chunk with an empty delta, the finish reason and, if
asked, the whole job's log-probabilities; with `stream_options.include_usage` a chunk with empty
`choices` and `usage` (and `usage: null` on every other chunk). The last chunk before
`data: [DONE]` carries `actq`, as in the non-streamed answer (the job id and activations manifest),
plus `live`: whether the text came as it was generated. The `x-actq-job-id` header names the job.

A stream that cannot be served live says so in a comment line (`: actq: not streamed live: ...`)
and with `actq.live: false`, and sends the whole text in one piece once the job has finished: an
Idempotency-Key replay of a job already finished, or of one submitted without `stream`; a scoring
job (`echo` with `max_tokens: 0`), and `echo` with generation (the prompt comes with the text).
One prompt and one choice per streamed request (`n` > 1 or several prompts: a 400). A client
that goes away does not cancel the job: it runs to its end, activations and all (DELETE
/jobs/{id} cancels it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import redis
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from api.bodies import in_turn, is_large
from api.context_check import refuse_overflow
from api.default_capture import with_default_capture
from api.deps import Services
from api.errors import redis_trouble
from api.job_text import JobTexts, TextFeed
from api.openai_errors import JOB_ID_HEADER, OpenAIError, after_queued, unfinished
from api.openai_protocol import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from api.openai_requests import completion_job_requests, to_job_requests
from api.openai_responses import completion, text_completion, whole_result
from api.run_labels import labelled
from api.submit import heavy, off_loop, submit
from shared.schemas import JobRecord, JobRequest, JobStatus

log = logging.getLogger("actq.api")
KEEPALIVE_SECONDS = 15.0  # a comment line when nothing else was sent for this long (proxies drop idle streams)
STREAM_OPTIONS = ("include_usage", "include_obfuscation")

Render = Callable[[JobRecord, Request], ChatCompletion | Completion]


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


def _one(job_requests: Sequence[JobRequest], body: ChatCompletionRequest | CompletionRequest) -> JobRequest:
    if len(job_requests) != 1:
        what = f"n={body.n}" if (body.n or 1) > 1 else f"{len(job_requests)} prompts"
        raise OpenAIError(
            400,
            f"a streamed request generates one choice of one prompt, not {what}: send n=1 and one prompt per "
            "streamed request, or leave stream out to get all choices in one answer",
            "unsupported_parameter",
            param="n" if (body.n or 1) > 1 else "prompt",
        )
    return job_requests[0]


async def stream_chat(
    services: Services, body: ChatCompletionRequest, request: Request, caller: str | None, key: str | None
) -> StreamingResponse:
    """POST /v1/chat/completions with `stream: true` (or with `stream_options`, refused without it)."""
    usage = _options(body)
    job_request = _one(labelled(request, await in_turn(request, services, caller, to_job_requests, body)), body)

    def render(record: JobRecord, request: Request) -> ChatCompletion:
        return completion([record], request, as_ids=bool(body.return_tokens_as_token_ids))

    return await _open(services, job_request, _Format(chat=True, usage=usage), render, request, caller, key, body)


async def stream_completion(
    services: Services, body: CompletionRequest, request: Request, caller: str | None, key: str | None
) -> StreamingResponse:
    """POST /v1/completions with `stream: true` (or with `stream_options`, refused without it)."""
    usage = _options(body)
    job_request = _one(labelled(request, await in_turn(request, services, caller, completion_job_requests, body)), body)
    echo, logprobs = bool(body.echo), body.logprobs is not None

    def render(record: JobRecord, request: Request) -> Completion:
        return text_completion(
            [record], request, echo=echo, logprobs=logprobs, as_ids=bool(body.return_tokens_as_token_ids)
        )

    fmt = _Format(chat=False, usage=usage)
    if echo:
        fmt.not_live = (
            "a scoring job (echo with max_tokens 0) generates no text step by step"
            if job_request.trace
            else "echo=true: the prompt comes with its completion"
        )
    return await _open(services, job_request, fmt, render, request, caller, key, body)


@dataclass
class _Format:
    """What the chunks of one stream look like."""

    chat: bool
    usage: bool  # stream_options.include_usage
    not_live: str | None = None  # why the text cannot come as it is generated
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

    def choice(self, text: str, finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}

    def piece(self, text: str) -> str:
        return self.chunk([self.choice(text)])


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
    job_request: JobRequest,
    fmt: _Format,
    render: Render,
    request: Request,
    caller: str | None,
    key: str | None,
    body: ChatCompletionRequest | CompletionRequest,
) -> StreamingResponse:
    """Take a long-poll place (the 429 comes before anything is queued), submit the job, and
    answer the stream of its events."""
    job_request = with_default_capture(services.settings, job_request, caller)
    if job_request.parses_tool_calls:
        fmt.not_live = "a reply that may call tools comes whole: its calls are read from the finished text"
    job_request = job_request.model_copy(update={"stream": fmt.not_live is None})
    held = AsyncExitStack()
    try:
        await held.enter_async_context(services.waiters.slot())
        await refuse_overflow(services, caller, [job_request])
        checks = heavy([job_request], await is_large(request))
        record, created = await off_loop(services, caller, checks, submit, services, job_request, key, caller)
        if not created and record.status.terminal:
            fmt.not_live = "the job had already finished (an Idempotency-Key replay)"
        elif not created and not record.request.stream:
            fmt.not_live = "the job (an Idempotency-Key replay) was submitted without stream"
        fmt.id, fmt.created, fmt.model = record.id, int(record.created_at.timestamp()), record.model
        feed = None
        if fmt.not_live is None:
            texts = _texts(request, services)
            feed = texts.open(record.id)
            held.callback(texts.close, feed)
        done = asyncio.ensure_future(services.waiters.wait(record.id, body.actq_wait_seconds))
        held.callback(done.cancel)
    except BaseException:
        await held.aclose()
        raise
    events = _events(services, fmt, render, request, record.id, feed, done, body.actq_wait_seconds, key)
    headers = {JOB_ID_HEADER: record.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _EventStream(events, held, headers)


async def _events(
    services: Services,
    fmt: _Format,
    render: Render,
    request: Request,
    job_id: str,
    feed: TextFeed | None,
    done: asyncio.Future[JobRecord | None],
    waited: float,
    key: str | None,
) -> AsyncIterator[str]:
    if fmt.chat:  # as OpenAI: the role first, with empty content
        yield fmt.chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )
    if fmt.not_live is not None:
        yield f": actq: not streamed live: {fmt.not_live}; the whole text comes when the job has finished\n\n"
    sent = ""
    try:
        async for text in _live(feed, done):
            if text is None:
                yield ": keep-alive\n\n"
                continue
            piece = text[len(sent) :]
            if piece:
                sent = text
                yield fmt.piece(piece)
        try:
            record = done.result()
        except Exception as exc:  # whatever it is, the job is queued: say so, and no retry
            log.warning("waiting for job %s failed: %r", job_id, exc)
            raise after_queued(job_id, exc) from exc
        if record is None:
            raise OpenAIError(500, f"job {job_id} is no longer stored", "job_not_found", job_id=job_id, retry=False)
        if record.status is not JobStatus.succeeded:
            raise unfinished(record, waited, key)
        answer = render(await whole_result(services.jobs, record), request)
        async for event in _ending(fmt, answer, sent, live=feed is not None and not fmt.not_live):
            yield event
    except OpenAIError as exc:
        yield _error(exc)
    except redis.RedisError as exc:
        yield _error(OpenAIError(503, redis_trouble(exc), "service_unavailable", job_id=job_id))
    except Exception:  # the stream has started: an error event, never a broken stream
        log.exception("streaming job %s failed", job_id)
        yield _error(OpenAIError(500, f"streaming job {job_id} failed; GET /jobs/{job_id} has it", "internal_error"))
    yield "data: [DONE]\n\n"


async def _live(feed: TextFeed | None, done: asyncio.Future[JobRecord | None]) -> AsyncIterator[str | None]:
    """The text so far each time it grows (None: nothing for KEEPALIVE_SECONDS), until the job
    has ended. Pieces that do not follow on from the text so far (entries trimmed or lost, a job
    run again after a lost worker) end the live text: the rest comes from the final text."""
    text = ""
    while not done.done():
        waits: set[asyncio.Future[Any]] = {done}
        ready = None
        if feed is not None:
            ready = asyncio.ensure_future(feed.ready.wait())
            waits.add(ready)
        try:
            finished, _ = await asyncio.wait(waits, timeout=KEEPALIVE_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if ready is not None:
                ready.cancel()
        if not finished:
            yield None
            continue
        if feed is None:
            continue
        grown = False
        for entry in feed.take():
            if entry is None:  # the job left the engine: its record says the rest
                feed = None
                break
            at, piece = entry
            overlap = min(len(text) - at, len(piece))  # what this entry repeats of the text so far
            if at > len(text) or text[at : at + overlap] != piece[:overlap]:
                feed = None  # a gap, or text that differs: no more live pieces
                break
            if at + len(piece) > len(text):
                text, grown = text[:at] + piece, True
        if grown:
            yield text


async def _ending(fmt: _Format, answer: ChatCompletion | Completion, sent: str, live: bool) -> AsyncIterator[str]:
    """The rest of the final text, the finish chunk, the usage chunk, `actq` on the last."""
    logprobs: BaseModel | None
    calls: list[dict[str, Any]] = []
    if isinstance(answer, ChatCompletion):
        chat = answer.choices[0]
        text, reason, logprobs = chat.message.content or "", chat.finish_reason, chat.logprobs
        calls = [{"index": i, **call.model_dump(mode="json")} for i, call in enumerate(chat.message.tool_calls or [])]
    else:
        legacy = answer.choices[0]
        text, reason, logprobs = legacy.text, legacy.finish_reason, legacy.logprobs
    if not text.startswith(sent):
        log.warning("job %s: its streamed text is not a prefix of its final text", fmt.id)
    if text[len(sent) :]:
        yield fmt.piece(text[len(sent) :])
    if calls:  # each call whole, in one delta (as OpenAI's chunks, which split the arguments)
        yield fmt.chunk([{"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}])
    actq = {**answer.actq.model_dump(mode="json"), "live": live}
    if fmt.not_live is not None:
        actq["not_live"] = fmt.not_live
    finish = fmt.choice("", reason, logprobs.model_dump(mode="json") if logprobs is not None else None)
    if not fmt.usage:
        yield fmt.chunk([finish], actq=actq)
        return
    yield fmt.chunk([finish])
    yield fmt.chunk([], usage=answer.usage.model_dump(mode="json"), actq=actq)

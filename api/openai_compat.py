"""OpenAI's chat completion and (legacy) completion shapes and their translation to and from actq jobs.

A chat completion request becomes an ordinary actq job (the same `JobRequest` as `POST /jobs`,
with `messages`); a completion request becomes one with a raw `prompt` (no chat template). The
answer is OpenAI's ChatCompletion or Completion with an extra `actq` field: the job id and the
activations manifest exactly as `GET /jobs/{id}` renders it. What actq cannot honour is refused
with a 400 naming the field (see `UNSUPPORTED` and `COMPLETION_UNSUPPORTED`); routes/openai.py
says what the endpoints do.

Errors under /v1 use OpenAI's error shape, because that is where OpenAI's clients look for the
message (`{"error": {"message", "type", "param", "code"}}`; `code` is actq's error type), plus
`detail` (the same message, as in every actq error) and, when a job exists, `error.job_id`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

import redis
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import where
from api.presenters import view
from shared.errors import ActqError, BadRequest, Busy, CaptureSpecError, CaptureTooLarge, NotReady, UnknownModel
from shared.schemas import ActivationsManifest, CaptureSpec, JobRecord, JobRequest, JobStatus, Usage

WAIT_DEFAULT_SECONDS = 300.0
WAIT_MAX_SECONDS = 3600.0

# A failed job's error type -> HTTP status. Only a prompt too long for the model is the client's doing.
FAILURE_STATUS = {"context_length_exceeded": 400}


# --- errors -------------------------------------------------------------------------------------


class OpenAIError(Exception):
    """An error answered in OpenAI's shape (see the module docstring)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        job_id: str | None = None,
        retry: bool | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.status, self.message, self.code, self.param, self.job_id, self.retry = (
            status,
            message,
            code,
            param,
            job_id,
            retry,
        )

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error: dict[str, Any] = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        if self.job_id is not None:
            error["job_id"] = self.job_id
        headers = {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse({"error": error, "detail": self.message}, status_code=self.status, headers=headers or None)


def _unsupported(field: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, "unsupported_parameter", param=field)


# endpoint -> whose fields it takes, for the message about an unknown field
ENDPOINT_FIELDS = {"/v1/chat/completions": "chat completion", "/v1/completions": "completion"}


def from_validation(errors: Sequence[Mapping[str, Any]], endpoint: str = "/v1/chat/completions") -> OpenAIError:
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError(400, "the request body is not valid JSON", "invalid_json")
    messages = []
    for e in errors:
        place = where(tuple(e.get("loc", ())))
        if e.get("type") == "extra_forbidden":
            fields = ENDPOINT_FIELDS.get(endpoint, "request")
            messages.append(
                f"unknown field {place!r}: {endpoint} takes OpenAI's {fields} fields "
                "plus 'capture' and 'actq_wait_seconds'"
            )
        else:
            messages.append(f"{place}: {e.get('msg')}")
    param = where(tuple(errors[0].get("loc", ()))) if errors else None
    return OpenAIError(400, "; ".join(messages), "invalid_request", param=param)


def from_actq(exc: ActqError) -> OpenAIError:
    if isinstance(exc, UnknownModel):
        return OpenAIError(404, exc.message, "model_not_found", param="model")
    if isinstance(exc, BadRequest):  # 422 under /jobs; OpenAI's clients expect 400 for a bad request
        param = "capture" if isinstance(exc, (CaptureSpecError, CaptureTooLarge)) else None
        return OpenAIError(400, exc.message, exc.error_type, param=param)
    if isinstance(exc, Busy):  # nothing was queued: the client's own retry (after Retry-After) is right
        return OpenAIError(429, exc.message, "rate_limit_exceeded", retry_after=exc.retry_after)
    # OpenAI's clients retry a 409 by themselves: right for NotReady ("retry shortly"), pointless otherwise.
    retry = isinstance(exc, NotReady) if exc.status_code == 409 else None
    return OpenAIError(exc.status_code, exc.message, exc.error_type, retry=retry)


# --- request ------------------------------------------------------------------------------------


class ContentPart(BaseModel):
    """One part of a list content; only `text` parts are read, the others are refused."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    # OpenAI's other message fields: refused unless null (see _message)
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None


class _GenerationRequest(BaseModel):
    """The fields OpenAI's chat and legacy completion requests share, plus actq's `capture` and
    `actq_wait_seconds`. Value ranges are JobRequest's (checked when the job request is built)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    capture: CaptureSpec | None = None
    actq_wait_seconds: Annotated[float, Field(gt=0, le=WAIT_MAX_SECONDS)] = WAIT_DEFAULT_SECONDS
    # Accepted only with a value actq honours (see UNSUPPORTED)
    n: int | None = None
    stream: bool | None = None
    stream_options: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    # Accepted and ignored: no effect on what the model generates
    user: Any = None


class ChatCompletionRequest(_GenerationRequest):
    """OpenAI's chat completion request (with the shared fields of `_GenerationRequest`)."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    # Accepted only with a value actq honours (see UNSUPPORTED)
    logprobs: bool | None = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # Accepted and ignored: no effect on what the model generates
    metadata: Any = None
    store: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    parallel_tool_calls: Any = None


_NO_TOOLS = "actq runs plain chat generation: tools and function calling are not supported"
_NO_LOGPROBS = "log probabilities are not returned (capture `lm_head` with positions 'generated' for the logits)"
# field -> (is the value one actq honours?, the refusal; {value} is the value sent)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (
        lambda v: v in (None, False),
        "streaming is not supported; send stream=false (the default): the answer comes once the job has "
        "finished, with its activations manifest",
    ),
    "stream_options": (lambda v: v is None, "stream_options is not supported: streaming is not supported"),
    "n": (
        lambda v: v in (None, 1),
        "n={value} is not supported: actq generates one choice per request; send n=1 (or several requests)",
    ),
    "logprobs": (lambda v: v in (None, False), f"logprobs={{value}} is not supported: {_NO_LOGPROBS}"),
    "top_logprobs": (lambda v: v in (None, 0), f"top_logprobs={{value}} is not supported: {_NO_LOGPROBS}"),
    "frequency_penalty": (
        lambda v: v in (None, 0),
        "frequency_penalty={value} is not supported: no penalties; send 0 or leave it out",
    ),
    "presence_penalty": (
        lambda v: v in (None, 0),
        "presence_penalty={value} is not supported: no penalties; send 0 or leave it out",
    ),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "tools": (lambda v: not v, f"tools are not supported: {_NO_TOOLS}"),
    "tool_choice": (lambda v: v in (None, "none"), f"tool_choice={{value}} is not supported: {_NO_TOOLS}"),
    "functions": (lambda v: not v, f"functions are not supported: {_NO_TOOLS}"),
    "function_call": (lambda v: v in (None, "none"), f"function_call={{value}} is not supported: {_NO_TOOLS}"),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        "response_format={value} is not supported: only plain text output ({{'type': 'text'}})",
    ),
    "modalities": (lambda v: v in (None, ["text"]), "modalities={value} is not supported: only text output"),
    "audio": (lambda v: v is None, "audio output is not supported: only text output"),
    "prediction": (lambda v: v is None, "prediction (predicted outputs) is not supported"),
    "reasoning_effort": (lambda v: v in (None, "none"), "reasoning_effort={value} is not supported"),
    "verbosity": (lambda v: v is None, "verbosity={value} is not supported; use max_tokens"),
    "service_tier": (
        lambda v: v in (None, "auto", "default"),
        "service_tier={value} is not supported (there are no service tiers)",
    ),
    "web_search_options": (lambda v: v is None, "web_search_options is not supported: no web search"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_supported(body: BaseModel, table: Mapping[str, tuple[Callable[[Any], bool], str]]) -> None:
    for field, (honoured, refusal) in table.items():
        value = getattr(body, field)
        if not honoured(value):
            raise _unsupported(field, refusal.format(value=_short(value)))


def _message(index: int, message: Message) -> dict[str, str]:
    """One OpenAI message as one actq message (role system/user/assistant, string content)."""
    where = f"messages[{index}]"
    if message.role in ("tool", "function"):
        raise _unsupported(f"{where}.role", f"{where}: role {message.role!r} is not supported: {_NO_TOOLS}")
    for field in ("tool_calls", "tool_call_id", "function_call"):
        if getattr(message, field) is not None:
            raise _unsupported(f"{where}.{field}", f"{where}.{field} is not supported: {_NO_TOOLS}")
    for field in ("refusal", "audio"):
        if getattr(message, field) is not None:
            raise _unsupported(f"{where}.{field}", f"{where}.{field} is not supported: messages are text content only")
    if message.name is not None:
        raise _unsupported(
            f"{where}.name",
            f"{where}.name is not supported (chat templates have no participant names); put the name in the content",
        )
    content = message.content
    if content is None:
        raise OpenAIError(
            400,
            f"{where}.content is required (a string or a list of text parts)",
            "invalid_request",
            param=f"{where}.content",
        )
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                what = (
                    f"content parts of type {part.type!r} are"
                    if part.type != "text"
                    else "a text part without 'text' is"
                )
                raise _unsupported(
                    f"{where}.content[{j}]",
                    f"{where}.content[{j}]: {what} not supported; send text parts "
                    f"({{'type': 'text', 'text': ...}}): the models actq serves read text",
                )
            texts.append(part.text)
        content = "".join(texts)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}


def to_job_request(body: ChatCompletionRequest) -> JobRequest:
    """The actq job an OpenAI chat completion request asks for (400 for what it cannot honour)."""
    _check_supported(body, UNSUPPORTED)
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise OpenAIError(
            400,
            "max_tokens and max_completion_tokens differ; send one of them",
            "invalid_request",
            param="max_completion_tokens",
        )
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [_message(i, m) for i, m in enumerate(body.messages)],
        "max_tokens": body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": body.stop,
        "capture": body.capture,
    }
    return _job_request(fields)


def _job_request(fields: dict[str, Any]) -> JobRequest:
    """JobRequest's own constraints (ranges, limits), exactly as for POST /jobs; a field left
    None takes JobRequest's default."""
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(list(exc.errors())) from None


class CompletionRequest(_GenerationRequest):
    """OpenAI's (legacy) completion request (with the shared fields of `_GenerationRequest`).
    `prompt` is typed loosely so that what actq cannot run (several prompts, token ids) gets a
    message saying what to send (`_prompt_text`) rather than pydantic's union errors."""

    prompt: Annotated[Any, Field(description="the text to complete: a string, or a list holding exactly one string")]
    # Accepted only with a value actq honours (see COMPLETION_UNSUPPORTED)
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# The chat refusals that mean the same here, plus the completion's own fields (legacy `logprobs`
# is a count of tokens, 0 asking for none).
COMPLETION_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{
        field: UNSUPPORTED[field]
        for field in ("stream", "stream_options", "n", "frequency_penalty", "presence_penalty", "logit_bias")
    },
    "logprobs": (
        lambda v: v in (None, 0),
        f"logprobs={{value}} is not supported: {_NO_LOGPROBS}; send 0 or leave it out",
    ),
    "echo": (
        lambda v: v in (None, False),
        "echo=true is not supported: the text returned is the completion only; send echo=false and prepend "
        "the prompt yourself (its activations: capture with positions 'prompt' or 'all')",
    ),
    "suffix": (
        lambda v: v is None,
        "suffix is not supported (no fill-in-the-middle): the model continues the prompt; leave suffix out",
    ),
    "best_of": (
        lambda v: v in (None, 1),
        "best_of={value} is not supported: actq generates one completion per request; send best_of=1 or leave it out",
    ),
}


def _invalid_prompt(message: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request", param="prompt")


def _prompt_text(prompt: Any) -> str:
    """The one text a completion request asks to continue. OpenAI also takes several prompts (one
    choice each) and token ids; an actq job is one text, tokenized by the worker as it is."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _invalid_prompt("prompt is empty: send the text to complete as a non-empty string")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise _unsupported(
            "prompt",
            f"prompt holds {len(prompt)} prompts: actq runs one prompt per request; send one string "
            "(or one request per prompt)",
        )
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise _unsupported(
            "prompt",
            "prompt as token ids is not supported: send the text as a string (the worker tokenizes it with "
            "the model's tokenizer)",
        )
    raise _invalid_prompt(
        f"prompt must be the text to complete, a non-empty string (or a list holding exactly one string), "
        f"not {_short(prompt)}"
    )


def completion_job_request(body: CompletionRequest) -> JobRequest:
    """The actq job an OpenAI completion request asks for: its prompt as raw text, tokenized as it
    is with no chat template (400 for what it cannot honour)."""
    _check_supported(body, COMPLETION_UNSUPPORTED)
    fields: dict[str, Any] = {
        "model": body.model,
        "prompt": _prompt_text(body.prompt),
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": body.stop,
        "capture": body.capture,
    }
    return _job_request(fields)


# --- response -----------------------------------------------------------------------------------


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ActqExtra(BaseModel):
    job_id: str
    activations: ActivationsManifest | None  # as GET /jobs/{id} renders it, with download_url


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    actq: ActqExtra


class TextChoice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    """OpenAI's (legacy) Completion, `object: "text_completion"`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
    actq: ActqExtra


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "actq"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _extra(record: JobRecord, request: Request) -> ActqExtra:
    """The `actq` field: the manifest as GET /jobs/{id} renders it (download_url included)."""
    return ActqExtra(job_id=record.id, activations=view(record, request).activations)


def completion(record: JobRecord, request: Request) -> ChatCompletion:
    assert record.result is not None
    return ChatCompletion(
        id=f"chatcmpl-{record.id}",
        created=int(record.created_at.timestamp()),
        model=record.model,
        choices=[
            Choice(
                index=0, message=AssistantMessage(content=record.result.text), finish_reason=record.result.finish_reason
            )
        ],
        usage=record.result.usage,
        actq=_extra(record, request),
    )


def text_completion(record: JobRecord, request: Request) -> Completion:
    """A succeeded job as OpenAI's Completion (finish_reason as for chat: a succeeded job stopped
    or ran to its length; cancelled and timed-out jobs are errors, see `unfinished`)."""
    assert record.result is not None
    return Completion(
        id=f"cmpl-{record.id}",
        created=int(record.created_at.timestamp()),
        model=record.model,
        choices=[TextChoice(text=record.result.text, index=0, finish_reason=record.result.finish_reason)],
        usage=record.result.usage,
        actq=_extra(record, request),
    )


def after_queued(job_id: str, exc: Exception) -> OpenAIError:
    """An error met once the job is queued (Redis lost while waiting): never retried by the
    client on its own, since a retry would queue a second job; the message names the job."""
    status = 503 if isinstance(exc, redis.RedisError) else 500
    reason = "Redis (the job store) could not be reached" if status == 503 else f"{type(exc).__name__}"
    message = f"job {job_id} is queued and keeps running, but waiting for it failed ({reason}): poll GET /jobs/{job_id}"
    return OpenAIError(status, message, "wait_failed", job_id=job_id, retry=False)


def unfinished(record: JobRecord, waited: float, idempotency_key: str | None) -> OpenAIError:
    job_id = record.id
    if record.status is JobStatus.failed:
        error = record.error
        kind, text = (error.type, error.message) if error is not None else ("internal_error", "no reason recorded")
        return OpenAIError(
            FAILURE_STATUS.get(kind, 500), f"job {job_id} failed: {text}", kind, job_id=job_id, retry=False
        )
    if record.status is JobStatus.cancelled:
        return OpenAIError(409, f"job {job_id} was cancelled", "cancelled", job_id=job_id, retry=False)
    message = (
        f"job {job_id} has not finished after {waited:g} s (it is {record.status.value}) and keeps running: "
        f"poll GET /jobs/{job_id}?wait=60, or resend this request with the same Idempotency-Key to wait for it again"
    )
    # With an Idempotency-Key a client retry waits for the same job; without one it would queue another.
    return OpenAIError(504, message, "wait_timeout", job_id=job_id, retry=idempotency_key is not None)

"""OpenAI's chat completion and (legacy) completion shapes and their translation to and from actq jobs.

A chat completion request becomes an ordinary actq job (the same `JobRequest` as `POST /jobs`,
with `messages`); a completion request becomes one with a raw `prompt` (no chat template). The
answer is OpenAI's ChatCompletion or Completion with an extra `actq` field: the job id and the
activations manifest exactly as `GET /jobs/{id}` renders it. What actq cannot honour is refused
with a 400 naming the field (see `UNSUPPORTED` and `COMPLETION_UNSUPPORTED`); routes/openai.py
says what the endpoints do.

Log-probabilities: chat `logprobs`/`top_logprobs` and the legacy completion's `logprobs` (a count)
become the job's `logprobs`/`top_logprobs`; the job's entries (`result.logprobs` of GET /jobs/{id})
are rendered in OpenAI's two shapes (`chat_logprobs`, `legacy_logprobs`). A legacy completion with
`echo: true` and `max_tokens: 0` is a trace job over the prompt (scoring the text, no generation).

Errors under /v1 use OpenAI's error shape, because that is where OpenAI's clients look for the
message (`{"error": {"message", "type", "param", "code"}}`; `code` is actq's error type), plus
`detail` (the same message, as in every actq error) and, when a job exists, `error.job_id`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import redis
from anyio import to_thread
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from api.errors import invalid_json, where
from api.presenters import view
from shared.errors import (
    ActqError,
    BadRequest,
    Busy,
    CaptureSpecError,
    CaptureTooLarge,
    InterventionError,
    InvalidSchema,
    NotReady,
    UnknownModel,
)
from shared.interventions import EditReport, Intervention
from shared.schemas import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    ActivationsManifest,
    BaselineResult,
    CaptureSpec,
    JobRecord,
    JobRequest,
    JobResult,
    JobStatus,
    Logprobs,
    Usage,
)
from shared.tools import ToolCall

if TYPE_CHECKING:
    from shared.jobs import JobStore

WAIT_DEFAULT_SECONDS = 300.0
MAX_JOBS_PER_REQUEST = 256  # prompts x n: each choice is its own job
MAX_CONTENT_PARTS = 1024  # parts of one message's list content
WAIT_MAX_SECONDS = 3600.0

# A failed job's error type -> HTTP status. Only a prompt too long for the model is the client's doing.
FAILURE_STATUS = {"context_length_exceeded": 400}


# --- errors -------------------------------------------------------------------------------------


# Every OpenAI-compatible answer about a job names it here too: clients that drop the body's
# extra `actq` field (LangChain, lm-eval) still see which job holds the activations.
JOB_ID_HEADER = "x-actq-job-id"


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
        if self.job_id is not None:
            headers[JOB_ID_HEADER] = self.job_id
        return JSONResponse({"error": error, "detail": self.message}, status_code=self.status, headers=headers or None)


def _unsupported(field: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, "unsupported_parameter", param=field)


# endpoint -> whose fields it takes, for the message about an unknown field
ENDPOINT_FIELDS = {"/v1/chat/completions": "chat completion", "/v1/completions": "completion"}


def from_validation(errors: Sequence[Mapping[str, Any]], endpoint: str = "/v1/chat/completions") -> OpenAIError:
    if (problem := invalid_json(errors)) is not None:
        return OpenAIError(400, problem, "invalid_json")
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
        param = "interventions" if isinstance(exc, InterventionError) else param
        param = exc.field if isinstance(exc, InvalidSchema) else param
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
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
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
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    capture: CaptureSpec | None = None
    interventions: list[Intervention] | None = None  # README "Interventions": the same as POST /jobs
    baseline: StrictBool = False
    actq_wait_seconds: Annotated[float, Field(gt=0, le=WAIT_MAX_SECONDS)] = WAIT_DEFAULT_SECONDS
    # Accepted only with a value actq honours (see UNSUPPORTED)
    n: int | None = None
    stream: StrictBool | None = None  # server-sent events: api/openai_stream.py
    stream_options: Any = None  # checked there (include_usage)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    # Stored with the job (GET /jobs shows them and filters on them); no effect on what runs
    user: str | None = None
    metadata: dict[str, str] | None = None


class ChatCompletionRequest(_GenerationRequest):
    """OpenAI's chat completion request (with the shared fields of `_GenerationRequest`)."""

    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)]  # bounded as it is validated (api/bodies.py)
    max_completion_tokens: int | None = None
    # Each generated token's log-probability, and the `top_logprobs` (0 to 20) likeliest tokens at its place
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    # Functions the model may call, whether it must, and JSON output (README "Tools and
    # structured output"); their shape is checked by JobRequest
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    # Accepted only with a value actq honours (see UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # Accepted and ignored: no effect on what the model generates
    store: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # false: with tool_choice "required" the reply is one call (enforced), not one or more; with
    # "auto" it is not enforced (a model that writes two calls gets both)
    parallel_tool_calls: StrictBool | None = None


_NO_FUNCTIONS = "the deprecated function calling is not supported: use tools and tool_choice"
# field -> (is the value one actq honours?, the refusal; {value} is the value sent)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (
        lambda v: v in (None, 0),
        "frequency_penalty={value} is not supported: no penalties; send 0 or leave it out",
    ),
    "presence_penalty": (
        lambda v: v in (None, 0),
        "presence_penalty={value} is not supported: no penalties; send 0 or leave it out",
    ),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "functions": (lambda v: not v, f"functions are not supported: {_NO_FUNCTIONS}"),
    "function_call": (lambda v: v in (None, "none"), f"function_call={{value}} is not supported: {_NO_FUNCTIONS}"),
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


def _message(index: int, message: Message) -> dict[str, Any]:
    """One OpenAI message as one actq message (roles system/user/assistant/tool, string content,
    an assistant's `tool_calls`, a tool message's `tool_call_id`; JobRequest checks their shape)."""
    where = f"messages[{index}]"
    if message.role == "function":
        raise _unsupported(
            f"{where}.role",
            f"{where}: role 'function' (the deprecated function calling) is not supported; use tools, "
            "and answer each call with a message of role 'tool' and its tool_call_id",
        )
    if message.function_call is not None:
        raise _unsupported(
            f"{where}.function_call",
            f"{where}.function_call (deprecated function calling) is not supported; use tool_calls",
        )
    for field in ("refusal", "audio"):
        if getattr(message, field) is not None:
            raise _unsupported(f"{where}.{field}", f"{where}.{field} is not supported: messages are text content only")
    if message.name is not None and message.role != "tool":
        raise _unsupported(
            f"{where}.name",
            f"{where}.name is not supported (chat templates have no participant names); put the name in the content",
        )
    content = message.content
    if content is None and not (message.role == "assistant" and message.tool_calls):
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
    out: dict[str, Any] = {"role": role, "content": content}
    if message.tool_calls is not None:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _top_count(field: str, value: int, what: str) -> None:
    """`value` alternatives per token must be 0 to MAX_TOP_LOGPROBS (as OpenAI's chat)."""
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise OpenAIError(
            400,
            f"{field}={value} is out of range: {what}, from 0 to {MAX_TOP_LOGPROBS}",
            "invalid_request",
            param=field,
        )


def _chat_logprobs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The job's `logprobs`/`top_logprobs` for chat's `logprobs` (bool) and `top_logprobs` (a count)."""
    top = body.top_logprobs
    if top is not None:
        _top_count("top_logprobs", top, "it is how many of the likeliest tokens to return at each place")
        if top > 0 and not body.logprobs:
            raise OpenAIError(
                400,
                f"top_logprobs={top} needs logprobs=true: send logprobs=true to get each generated token's "
                f"log-probability and the {top} likeliest tokens at its place (or leave top_logprobs out)",
                "invalid_request",
                param="top_logprobs",
            )
    return {"logprobs": bool(body.logprobs), "top_logprobs": top if body.logprobs else None}


def to_job_requests(body: ChatCompletionRequest) -> list[JobRequest]:
    """The actq jobs an OpenAI chat completion request asks for, one per choice (`n`; choice j of
    a seeded request draws with seed + j); 400 for what it cannot honour."""
    _check_supported(body, UNSUPPORTED)
    n = _choices(body)
    logprobs = _chat_logprobs(body)
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
        "stop": body.stop,
        "capture": body.capture,
        "interventions": body.interventions,
        "baseline": body.baseline,
        "metadata": body.metadata,
        "user": body.user,
        "tools": body.tools,
        "tool_choice": body.tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": None if body.response_format == {"type": "text"} else body.response_format,
        **logprobs,
    }
    return [_job_request({**fields, "seed": _choice_seed(body.seed, choice)}) for choice in range(n)]


def _job_request(fields: dict[str, Any]) -> JobRequest:
    """JobRequest's own constraints (ranges, limits), exactly as for POST /jobs; a field left
    None takes JobRequest's default."""
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(list(exc.errors())) from None


class CompletionRequest(_GenerationRequest):
    """OpenAI's (legacy) completion request (with the shared fields of `_GenerationRequest`).
    `prompt` is typed loosely so that a bad one gets a message saying what to send (`_prompts`)
    rather than pydantic's union errors."""

    prompt: Annotated[
        Any,
        Field(
            description="the text to complete: a string, a list of strings (one choice each), a list of token ids, "
            "or a list of lists of token ids"
        ),
    ]
    # Legacy `logprobs` is a count: each token's log-probability and its `logprobs` (0 to 20) likeliest
    # alternatives. `echo`: the prompt before the text (and with logprobs, its tokens' log-probabilities
    # first); with max_tokens 0 the prompt is only scored.
    echo: StrictBool | None = None
    logprobs: int | None = None
    # Accepted only with a value actq honours (see COMPLETION_UNSUPPORTED)
    suffix: str | None = None
    best_of: int | None = None


# The chat refusals that mean the same here, plus the completion's own fields (`echo` and
# `max_tokens` are checked together in `completion_job_requests`).
COMPLETION_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{field: UNSUPPORTED[field] for field in ("frequency_penalty", "presence_penalty", "logit_bias")},
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


Prompt = str | list[int]


def _token_ids(value: list[Any], where: str) -> list[int]:
    if not value:
        raise _invalid_prompt(f"{where} is an empty list of token ids: send at least one token id")
    for j, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _invalid_prompt(f"{where}[{j}]={_short(token)} is not a token id (an integer >= 0)")
    return value


def _prompts(prompt: Any) -> list[Prompt]:
    """The prompts of a completion request, in order: OpenAI's four shapes (a string, a list of
    strings, a list of token ids, a list of lists of token ids). A text is tokenized by the worker
    as it is; token ids are fed as given (no BOS added), checked against the vocabulary at submit."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_token_ids(prompt, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise _invalid_prompt(
            f"prompt must be the text to complete (a non-empty string), a list of strings, a list of token ids or a "
            f"list of lists of token ids, not {_short(prompt)}"
        )
    prompts: list[Prompt] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            if not item:
                raise _invalid_prompt(f"prompt[{i}] is empty: send the text to complete as a non-empty string")
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append(_token_ids(item, f"prompt[{i}]"))
        else:
            raise _invalid_prompt(
                f"prompt[{i}] must be a string or a list of token ids (all prompts of one shape), not {_short(item)}"
            )
    return prompts


def _choices(body: _GenerationRequest, prompts: int = 1) -> int:
    """`n`, checked: each choice is its own job, and one request makes at most MAX_JOBS_PER_REQUEST."""
    n = 1 if body.n is None else body.n
    if n < 1:
        raise OpenAIError(
            400, f"n={n} is out of range: n is how many choices to generate, at least 1", "invalid_request", param="n"
        )
    if prompts * n > MAX_JOBS_PER_REQUEST:
        what = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
        raise OpenAIError(
            400,
            f"{what} would make {prompts * n} jobs: one request makes at most {MAX_JOBS_PER_REQUEST}; split it, or "
            "use POST /jobs/batch",
            "invalid_request",
            param="n" if n > 1 else "prompt",
        )
    return n


def _choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice j of a seeded request draws with seed + j: reproducible, and the choices differ."""
    return None if seed is None else (seed + choice) % 2**63


def _scoring(body: CompletionRequest) -> Literal["trace", "echo", "plain"]:
    """What the request asks of its prompt: `trace` scores it alone (`echo: true` with `max_tokens: 0`:
    one forward pass, nothing generated); `echo` generates and answers the prompt before the text
    (with `logprobs`, the prompt's log-probabilities from the same prefill); `plain` generates."""
    if body.echo:
        return "trace" if body.max_tokens == 0 else "echo"
    if body.max_tokens == 0:
        raise OpenAIError(
            400,
            "max_tokens=0 generates nothing, and without echo=true there is nothing to return: send max_tokens >= 1 "
            "to generate, or echo=true with max_tokens=0 (and logprobs) to score the prompt",
            "invalid_request",
            param="max_tokens",
        )
    return "plain"


def completion_job_requests(body: CompletionRequest) -> list[JobRequest]:
    """The actq jobs an OpenAI completion request asks for, in choice order (choice i = prompt
    i // n, its (i % n)th choice): each prompt as raw text (tokenized as it is, no chat template) or
    as token ids; 400 for what actq cannot honour. With `echo: true` and `max_tokens: 0` a job is a
    trace over its prompt: nothing is sampled, so temperature, top_p, seed and stop have no effect
    and are left out (OpenAI and vLLM accept them there too). An echo of token ids always scores
    the prompt: its log-probability entries give the prompt's text."""
    _check_supported(body, COMPLETION_UNSUPPORTED)
    if body.logprobs is not None:
        what = "the legacy logprobs is how many of the likeliest tokens to return at each place"
        _top_count("logprobs", body.logprobs, f"{what} (0: each token's own log-probability only)")
    prompts = _prompts(body.prompt)
    n = _choices(body, len(prompts))
    scoring = _scoring(body)
    common: dict[str, Any] = {
        "model": body.model,
        "capture": body.capture,
        "interventions": body.interventions,
        "baseline": body.baseline,
        "metadata": body.metadata,
        "user": body.user,
    }
    jobs = []
    for prompt in prompts:
        ids = isinstance(prompt, list)
        scored = scoring != "plain" and (body.logprobs is not None or ids)
        fields = {
            **common,
            "prompt_token_ids" if ids else "prompt": prompt,
            "logprobs": body.logprobs is not None or scored,
            "top_logprobs": body.logprobs or None,
        }
        for choice in range(n):
            if scoring == "trace":
                jobs.append(_job_request({**fields, "mode": "trace"}))
                continue
            sampling = {
                "temperature": body.temperature,
                "top_p": body.top_p,
                "seed": _choice_seed(body.seed, choice),
                "stop": body.stop,
                "prompt_logprobs": scored or None,
            }
            jobs.append(_job_request({**fields, "max_tokens": body.max_tokens, **sampling}))
    return jobs


# --- response -----------------------------------------------------------------------------------


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None  # only when the reply made calls (as OpenAI leaves it out)

    @classmethod
    def of(cls, result: JobResult) -> AssistantMessage:
        """A job's reply: its calls and the text outside them, or its whole text."""
        if result.tool_calls:
            return cls(content=result.content, tool_calls=result.tool_calls)
        return cls(content=result.text)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the UTF-8 bytes of `token`


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChoiceLogprobs(BaseModel):
    """OpenAI's ChatCompletion `choices[].logprobs`."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChoiceExtra(BaseModel):
    job_id: str
    activations: ActivationsManifest | None  # as GET /jobs/{id} renders it, with download_url
    interventions: list[EditReport] | None = None  # per edit, the positions it touched at each step
    baseline: BaselineResult | None = None  # `baseline: true`: the same request without its edits


class ActqExtra(ChoiceExtra):
    """The first choice's job at the top (the only one, for one prompt and n = 1); with several
    choices, `choices[i]` is choice i's job."""

    choices: list[ChoiceExtra] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    actq: ActqExtra


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy Completion `choices[].logprobs`: parallel lists, one place per token.
    `top_logprobs` is null when no alternatives were asked for (logprobs 0)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first token of a scored prompt (nothing predicts it)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TextChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
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
    whole = await to_thread.run_sync(JobResult.model_validate_json, raw)
    return record.model_copy(update={"result": whole})


def _inline_logprobs(record: JobRecord) -> Logprobs | None:
    """The job's log-probabilities when its request asked for them; a 400 naming the job when there
    were too many to hold inline (they are in its activations file instead)."""
    result = record.result
    if result is None or not record.request.logprobs or result.logprobs is None:
        return None
    if result.logprobs.content is None:
        tokens = result.usage.prompt_tokens if record.request.trace else result.usage.completion_tokens
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


def chat_logprobs(record: JobRecord) -> ChoiceLogprobs | None:
    """The job's generated tokens' log-probabilities in OpenAI's ChatCompletion shape (None when
    not asked for). A token is its text decoded alone, so a piece of a multi-byte character is
    U+FFFD, and `bytes` are that text's UTF-8 bytes (the token ids are in GET /jobs/{id})."""
    logprobs = _inline_logprobs(record)
    if logprobs is None:
        return None
    return ChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=entry.token,
                logprob=_openai_logprob(entry.logprob),
                bytes=_utf8(entry.token),
                top_logprobs=[
                    ChatTopLogprob(token=top.token, logprob=_openai_logprob(top.logprob), bytes=_utf8(top.token))
                    for top in entry.top_logprobs
                ],
            )
            for entry in logprobs.content or []
        ]
    )


def _scores_prompt(record: JobRecord) -> bool:
    """Whether the job's log-probability entries begin with its prompt's (a trace; an echo)."""
    return record.request.trace or record.request.prompt_logprobs


def legacy_logprobs(record: JobRecord) -> CompletionLogprobs | None:
    """The job's log-probabilities in OpenAI's legacy Completion shape (None when not asked for):
    generated tokens, or with echo every token of the prompt first (then the generated ones), the
    prompt's first with no log-probability (None, and None in `top_logprobs`). `top_logprobs[i]`
    maps the k likeliest tokens' texts to their log-probabilities (tokens that decode to the same
    text share one key). `text_offset[i]` is where token i starts in the returned text, counted
    over the tokens' texts before it: exact when the tokens' texts join into the text, which they
    do but for a BOS the tokenizer adds (its text, e.g. "<s>", is not in the prompt), a character
    split across tokens (each piece is U+FFFD), and tokens past a stop string (the text ends before
    the stop string, the tokens go on to the last one generated)."""
    logprobs = _inline_logprobs(record)
    if logprobs is None:
        return None
    entries = logprobs.content or []
    first_unscored = _scores_prompt(record)
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    values: list[float | None] = [
        None if first_unscored and i == 0 else _openai_logprob(entry.logprob) for i, entry in enumerate(entries)
    ]
    top: list[dict[str, float] | None] | None = None
    if record.request.top_k:
        top = [
            None if first_unscored and i == 0 else {t.token: _openai_logprob(t.logprob) for t in entry.top_logprobs}
            for i, entry in enumerate(entries)
        ]
    return CompletionLogprobs(
        tokens=[entry.token for entry in entries], token_logprobs=values, top_logprobs=top, text_offset=offsets
    )


def _first_id(records: list[JobRecord]) -> str:
    return records[0].id


def completion(records: list[JobRecord], request: Request) -> ChatCompletion:
    """Succeeded jobs, one per choice, as OpenAI's ChatCompletion."""
    choices = []
    for index, record in enumerate(records):
        assert record.result is not None
        choices.append(
            Choice(
                index=index,
                message=AssistantMessage.of(record.result),
                finish_reason=record.result.finish_reason,
                logprobs=chat_logprobs(record),
            )
        )
    return ChatCompletion(
        id=f"chatcmpl-{_first_id(records)}",
        created=int(records[0].created_at.timestamp()),
        model=records[0].model,
        choices=choices,
        usage=_usage(records),
        actq=_extra(records, request),
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


def _text_choice(index: int, record: JobRecord, echo: bool, logprobs: bool) -> TextChoice:
    result = record.result
    assert result is not None
    text = _prompt_text(record) + result.text if echo else result.text
    shown = legacy_logprobs(record) if logprobs else None
    return TextChoice(text=text, index=index, finish_reason=result.finish_reason, logprobs=shown)


def text_completion(records: list[JobRecord], request: Request, echo: bool, logprobs: bool) -> Completion:
    """Succeeded jobs, one per choice, as OpenAI's Completion (finish_reason as for chat: a
    succeeded job stopped or ran to its length; cancelled and timed-out jobs are errors, see
    `unfinished`). With `echo` the text begins with the prompt; a trace job (echo with max_tokens
    0) answers its prompt alone, with finish_reason "length" (as OpenAI: the 0 tokens asked for were
    generated). `logprobs`: whether the request asked for them (an echo of token ids scores its
    prompt without being asked, for the prompt's text)."""
    return Completion(
        id=f"cmpl-{_first_id(records)}",
        created=int(records[0].created_at.timestamp()),
        model=records[0].model,
        choices=[_text_choice(i, record, echo, logprobs) for i, record in enumerate(records)],
        usage=_usage(records),
        actq=_extra(records, request),
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

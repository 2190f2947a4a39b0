"""OpenAI's chat completion and (legacy) completion request and response shapes, as actq takes and
answers them (vLLM's `protocol.py`). A request's fields that actq cannot honour are typed loosely
here and refused with a 400 naming the field by api/openai/requests.py; the responses carry an
extra `actq` field: the job id and the activations manifest exactly as `GET /jobs/{id}` renders it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from shared.interventions import EditReport, Intervention
from shared.schemas import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    ActivationsManifest,
    BaselineResult,
    CaptureSpec,
    JobResult,
    Usage,
)
from shared.tools import ToolCall

if TYPE_CHECKING:
    pass

WAIT_DEFAULT_SECONDS = 300.0
MAX_CONTENT_PARTS = 1024  # parts of one message's list content
WAIT_MAX_SECONDS = 3600.0


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


class GenerationRequest(BaseModel):
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
    interventions: list[Intervention] | None = None  # docs/interventions.md: the same as POST /jobs
    baseline: StrictBool = False
    actq_wait_seconds: Annotated[float, Field(gt=0, le=WAIT_MAX_SECONDS)] = WAIT_DEFAULT_SECONDS
    # Accepted only with a value actq honours (see UNSUPPORTED)
    n: int | None = None
    stream: StrictBool | None = None  # server-sent events: api/openai/stream.py
    stream_options: Any = None  # checked there (include_usage)
    # vLLM's: logprob entries name tokens as "token_id:<id>" (a piece of a character stays identifiable)
    return_tokens_as_token_ids: StrictBool | None = None
    # vLLM's: each prompt token's log-probability and rank, with this many (0 to 20) likeliest alternatives
    prompt_logprobs: int | None = None
    # OpenAI's penalties and logit_bias, and vLLM's sampling extras: checked by JobRequest (ranges)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    # vLLM's constrained output: `structured_outputs` (one of json, json_object, regex, choice,
    # grammar: shared/structured_outputs.py), or one of its deprecated names below (api/openai/requests.py)
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Stored with the job (GET /jobs shows them and filters on them); no effect on what runs
    user: str | None = None
    metadata: dict[str, str] | None = None


class ChatCompletionRequest(GenerationRequest):
    """OpenAI's chat completion request (with the shared fields of `GenerationRequest`)."""

    messages: Annotated[list[Message], Field(max_length=MAX_MESSAGES)]  # bounded as it is validated (api/bodies.py)
    max_completion_tokens: int | None = None
    # Each generated token's log-probability, and the `top_logprobs` (0 to 20) likeliest tokens at its place
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    # Functions the model may call, whether it must, and JSON output (docs/openai.md, "Tools and
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
    # vLLM's chat extras: how the chat is rendered (an assistant prefill with
    # continue_final_message, template variables such as enable_thinking); checked by JobRequest
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat `echo`: the reply's content begins with the last message's, when that message
    # has the reply's role (api/openai/requests.py, `echoed`)
    echo: StrictBool | None = None


class CompletionRequest(GenerationRequest):
    """OpenAI's (legacy) completion request (with the shared fields of `GenerationRequest`).
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None  # only when the reply made calls (as OpenAI leaves it out)

    @classmethod
    def of(cls, result: JobResult) -> AssistantMessage:
        """A job's reply: its calls and the text outside them, or its text (never call markup: a
        call that did not parse is in the job's `result.tool_call_problems`, not here)."""
        if result.tool_calls:
            return cls(content=result.content, tool_calls=result.tool_calls)
        if result.tool_call_problems:  # no call made: the text outside what looked like one
            return cls(content=result.content or "")
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


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs`."""

    logprob: float
    rank: int | None  # how many tokens were at least as likely, itself included (1: the likeliest)
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id (as a string) -> entry
PromptLogprobs = list[dict[str, PromptLogprob] | None]


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
    # vLLM's, for the request's one prompt; left out unless asked for (OpenAI's shape has no such field)
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)


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
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)  # vLLM's, as above


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

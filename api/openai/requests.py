"""OpenAI requests to actq jobs. A chat completion request becomes an ordinary actq job (the same
`JobRequest` as `POST /jobs`, with `messages`); a completion request becomes one with a raw
`prompt` (no chat template); one job per choice. What actq cannot honour is refused with a 400
naming the field (`UNSUPPORTED` and `COMPLETION_UNSUPPORTED`).

Log-probabilities: chat `logprobs`/`top_logprobs` and the legacy completion's `logprobs` (a count)
become the job's `logprobs`/`top_logprobs`; vLLM's `prompt_logprobs` (both routes) makes the job
score its prompt too (`prompt_logprobs`). A legacy completion with `echo: true` and
`max_tokens: 0` is a trace job over the prompt (scoring the text, no generation).

vLLM's extras: `structured_outputs` (and its deprecated names `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`) becomes the job's `structured_outputs`; chat `echo` puts the
last message's content before the reply's (`echoed`, shown by api/openai/responses.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from api.openai.errors import OpenAIError, from_validation, unsupported
from api.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, Message
from shared.schemas import (
    MAX_TOP_LOGPROBS,
    JobRequest,
)

if TYPE_CHECKING:
    pass

MAX_JOBS_PER_REQUEST = 256  # prompts x n: each choice is its own job


_NO_FUNCTIONS = "the deprecated function calling is not supported: use tools and tool_choice"
# field -> (is the value one actq honours?, the refusal; {value} is the value sent)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
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
            raise unsupported(field, refusal.format(value=_short(value)))


def _message(index: int, message: Message) -> dict[str, Any]:
    """One OpenAI message as one actq message (roles system/user/assistant/tool, string content,
    an assistant's `tool_calls`, a tool message's `tool_call_id`; JobRequest checks their shape)."""
    where = f"messages[{index}]"
    if message.role == "function":
        raise unsupported(
            f"{where}.role",
            f"{where}: role 'function' (the deprecated function calling) is not supported; use tools, "
            "and answer each call with a message of role 'tool' and its tool_call_id",
        )
    if message.function_call is not None:
        raise unsupported(
            f"{where}.function_call",
            f"{where}.function_call (deprecated function calling) is not supported; use tool_calls",
        )
    for field in ("refusal", "audio"):
        if getattr(message, field) is not None:
            raise unsupported(f"{where}.{field}", f"{where}.{field} is not supported: messages are text content only")
    if message.name is not None and message.role != "tool":
        raise unsupported(
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
                raise unsupported(
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
    return _with_prompt(body, {"logprobs": bool(body.logprobs), "top_logprobs": top if body.logprobs else None})


def _with_prompt(body: GenerationRequest, fields: dict[str, Any]) -> dict[str, Any]:
    """The job's log-probability fields with vLLM's `prompt_logprobs` (k: each prompt token's, and
    its k likeliest alternatives) added: the job scores its prompt in the same prefill and holds the
    larger count of alternatives (the answer shows each part its own count: api/openai/responses.py)."""
    k = body.prompt_logprobs
    if k is None:
        return fields
    what = "vLLM's prompt_logprobs is how many of the likeliest tokens to return at each prompt token"
    _top_count("prompt_logprobs", k, f"{what} (0: each prompt token's own log-probability and rank only)")
    if body.stream:
        raise OpenAIError(
            400,
            "prompt_logprobs is not streamed: leave stream out to get them, or prompt_logprobs out to stream",
            "unsupported_parameter",
            param="prompt_logprobs",
        )
    top = max(fields.get("top_logprobs") or 0, k)
    return {**fields, "logprobs": True, "top_logprobs": top or None, "prompt_logprobs": True}


# vLLM's deprecated names of the structured_outputs keys
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(body: GenerationRequest, response_format: Any = None) -> Any:
    """The job's `structured_outputs`: vLLM's own, or the one `guided_*` field given as the key it
    stands for (JobRequest checks the shape); 400 for two constraints at once."""
    given = [name for name in GUIDED if getattr(body, name) is not None]
    if len(given) > 1:
        raise OpenAIError(
            400,
            f"{given[0]} and {given[1]} each constrain the reply: send one of them",
            "invalid_request",
            param=given[1],
        )
    if not given:
        return body.structured_outputs
    name = given[0]
    if body.structured_outputs is not None:
        raise OpenAIError(
            400,
            f"{name} is the deprecated name of structured_outputs.{GUIDED[name]}, and structured_outputs is given too: "
            "send structured_outputs alone",
            "invalid_request",
            param=name,
        )
    if response_format is not None:
        raise OpenAIError(
            400, f"{name} and response_format each constrain the reply: send one of them", "invalid_request", param=name
        )
    return {GUIDED[name]: getattr(body, name)}


def echoed(body: ChatCompletionRequest) -> str:
    """What chat `echo` puts before the reply's content, as vLLM does: the last message's text
    when its role is the reply's (the assistant's, when the rendering opens its turn; otherwise the
    last message's own, which then always matches); "" without `echo`. List content is joined
    with newlines, as vLLM joins it."""
    if not body.echo or not body.messages:
        return ""
    last = body.messages[-1]
    opens_turn = body.add_generation_prompt is not False and not body.continue_final_message
    if opens_turn and last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "\n".join(part.text or "" for part in last.content)
    return last.content or ""


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
    response_format = None if body.response_format == {"type": "text"} else body.response_format
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": [_message(i, m) for i, m in enumerate(body.messages)],
        "max_tokens": body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        **shaping(body),
        "stop": body.stop,
        "capture": body.capture,
        "interventions": body.interventions,
        "baseline": body.baseline,
        "metadata": body.metadata,
        "user": body.user,
        "tools": body.tools,
        "tool_choice": body.tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format,
        "structured_outputs": structured_outputs(body, response_format),
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template_kwargs": body.chat_template_kwargs,
        **logprobs,
    }
    return [_job_request({**fields, "seed": _choice_seed(body.seed, choice)}) for choice in range(n)]


def shaping(body: GenerationRequest) -> dict[str, Any]:
    """The sampler's other settings, as the job takes them (None: the default)."""
    fields = ("top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty")
    return {field: getattr(body, field) for field in fields} | {"logit_bias": body.logit_bias or None}


def _job_request(fields: dict[str, Any]) -> JobRequest:
    """JobRequest's own constraints (ranges, limits), exactly as for POST /jobs; a field left
    None takes JobRequest's default."""
    try:
        return JobRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise from_validation(list(exc.errors())) from None


# The chat refusals that mean the same here, plus the completion's own fields (`echo` and
# `max_tokens` are checked together in `completion_job_requests`).
COMPLETION_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
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


def _choices(body: GenerationRequest, prompts: int = 1) -> int:
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
        "structured_outputs": structured_outputs(body),
    }
    jobs = []
    for prompt in prompts:
        ids = isinstance(prompt, list)
        scored = scoring != "plain" and (body.logprobs is not None or ids)
        fields = {
            **common,
            "prompt_token_ids" if ids else "prompt": prompt,
            **_with_prompt(
                body,
                {
                    "logprobs": body.logprobs is not None or scored,
                    "top_logprobs": body.logprobs or None,
                    "prompt_logprobs": scored or None,
                },
            ),
        }
        for choice in range(n):
            if scoring == "trace":  # its entries are all the prompt's
                jobs.append(_job_request({**fields, "mode": "trace", "prompt_logprobs": None}))
                continue
            sampling = {
                "temperature": body.temperature,
                "top_p": body.top_p,
                **shaping(body),
                "seed": _choice_seed(body.seed, choice),
                "stop": body.stop,
            }
            jobs.append(_job_request({**fields, "max_tokens": body.max_tokens, **sampling}))
    return jobs

"""OpenAI-compatible endpoints: `POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models`.

A chat completion request becomes an ordinary actq job (the same `JobRequest`, the same
`api.submit.submit`: validation, capture budget, idempotency and enqueueing are shared with
`POST /jobs`); the route then waits for the job (async, on its Redis pub/sub channel) and answers
in OpenAI's ChatCompletion shape, with an extra `actq` field: the job id and the activations
manifest exactly as `GET /jobs/{id}` renders it.

A (legacy) completion request goes the same way (`_finished`) as a job with a raw `prompt`: the
text is tokenized as it is (the tokenizer's own BOS included), with no chat template, which is
what base models and probing on exact text need. The answer is OpenAI's Completion (`id`
"cmpl-" + job id, `object: "text_completion"`, `choices[0].text`), with the same `actq` field.
`prompt` is a string or a list holding exactly one string; several prompts or token ids are a 400.
Refused as for chat: `n` > 1, streaming, penalties, logit bias; and the completion's own `suffix`
and `best_of` > 1. `user` is accepted and ignored. `echo: true` works with `max_tokens: 0` only:
that scores the prompt (a trace job, one forward pass, nothing generated) and answers the prompt
as the text; `echo` with generation is a 400, and so is `max_tokens: 0` without `echo`.

Log-probabilities: chat's `logprobs: true` and `top_logprobs` (0 to 20; without logprobs a 400)
answer `choices[0].logprobs` in OpenAI's chat shape (`content`: token, logprob, bytes,
top_logprobs); the legacy `logprobs: k` (0 to 20) answers OpenAI's legacy shape (`tokens`,
`token_logprobs`, `top_logprobs` of k entries per place or null for 0, `text_offset`). They are
the job's own (`result.logprobs` of GET /jobs/{id}): log_softmax of the raw logits, before
temperature and top_p. More entries than the worker holds inline (ACTQ_LOGPROBS_INLINE_TOKENS)
answer a 400 `logprobs_too_long` naming the job, whose activations file has them.

Differences from OpenAI, each refused with a 400 naming the field rather than silently ignored:
no streaming, one choice (`n` = 1), no tools or function calls, no penalties or logit bias, text
only (content parts other than `text`, audio, images), `response_format` text only. `user`,
`metadata`, `store`, `safety_identifier` and the prompt-cache hints are accepted and ignored. A
`developer` message is a `system` message; list content (`[{"type": "text", "text":
...}]`) is the concatenation of its text parts, with no separator. Two extra request fields:
`capture` (as in `POST /jobs`) and `actq_wait_seconds` (how long to wait for the job, default 300,
at most 3600; past it the answer is a 504 naming the job, which keeps running: poll
`GET /jobs/{id}`). An `Idempotency-Key` header works as for `POST /jobs`: resending a timed-out
request with the same key waits for the same job instead of queueing another.

Errors under /v1 use OpenAI's error shape (api/openai_compat.py says how); responses about a job
that ran (failed, cancelled, still running) carry `x-should-retry: false`, so that OpenAI's
clients do not resubmit it on their own: a retry would queue a new job. So does any error met while
waiting for a queued job (`wait_failed`, naming the job). The wait takes one of the process's
long-poll places (ACTQ_MAX_LONG_POLLS); when none is free the answer is a 429 with `Retry-After`
before anything is queued, which the client's own retry handles. Both completion endpoints share
this flow (`_finished`), so they cannot drift apart on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from api.deps import CallerDep, Services, ServicesDep, get_caller
from api.errors import redis_trouble
from api.openai_compat import (
    JOB_ID_HEADER,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    OpenAIError,
    after_queued,
    completion,
    completion_job_request,
    from_actq,
    from_validation,
    text_completion,
    to_job_request,
    unfinished,
    whole_result,
)
from api.submit import submit
from shared.errors import ActqError
from shared.schemas import JobRecord, JobRequest, JobStatus


class OpenAIRoute(APIRoute):
    """Renders every error of these routes in OpenAI's shape (the app's handlers use actq's)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as exc:
                return exc.response()
            except RequestValidationError as exc:
                return from_validation(list(exc.errors()), self.path).response()
            except ActqError as exc:
                return from_actq(exc).response()
            except HTTPException as exc:
                return OpenAIError(exc.status_code, str(exc.detail), "http_error").response()
            except redis.RedisError as exc:
                return OpenAIError(503, redis_trouble(exc), "service_unavailable").response()

        return route


log = logging.getLogger("actq.api")
router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute, dependencies=[Depends(get_caller)])


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid or unsupported request"},
    404: {"description": "Unknown model"},
    429: {"description": "Every long-poll place of this API process is taken (Retry-After)"},
    500: {"description": "The job failed"},
    503: {},
    504: {"description": "The job did not finish in time"},
}


IdempotencyKey = Annotated[str | None, Header(min_length=1, max_length=256)]


async def _finished(
    services: Services, job_request: JobRequest, wait_seconds: float, idempotency_key: str | None, caller: str | None
) -> JobRecord:
    """Submit the job and wait for it; its record once it has succeeded, else the error to answer.
    The long-poll place is taken before submitting: at capacity the 429 comes before anything is
    queued, so the client's own retry cannot make a second job."""
    async with services.waiters.slot():
        record, _ = await run_in_threadpool(submit, services, job_request, idempotency_key, caller)
        if not record.status.terminal:
            try:
                record = await services.waiters.wait(record.id, wait_seconds) or record
            except Exception as exc:  # whatever it is, the job is queued: say so, and no retry
                log.warning("waiting for job %s failed: %r", record.id, exc)
                raise after_queued(record.id, exc) from exc
    if record.status is not JobStatus.succeeded:
        raise unfinished(record, wait_seconds, idempotency_key)
    return await whole_result(services.jobs, record)  # a result stored apart: its logprobs, its whole text


@router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(
    body: ChatCompletionRequest,
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> ChatCompletion:
    """OpenAI's chat completion, run as an actq job (with an optional `capture`): answers once the
    job has finished, with the job id and its activations manifest in the extra field `actq`."""
    job_request = to_job_request(body)
    record = await _finished(services, job_request, body.actq_wait_seconds, idempotency_key, caller)
    response.headers[JOB_ID_HEADER] = record.id
    return completion(record, request)


@router.post("/completions", response_model=Completion, responses=ERRORS)
async def completions(
    body: CompletionRequest,
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> Completion:
    """OpenAI's (legacy) completion: the prompt as raw text, tokenized as it is with no chat
    template, run as an actq job (with an optional `capture`); answers like the chat completion,
    with the job id and its activations manifest in the extra field `actq`."""
    job_request = completion_job_request(body)
    record = await _finished(services, job_request, body.actq_wait_seconds, idempotency_key, caller)
    response.headers[JOB_ID_HEADER] = record.id
    return text_completion(record, request)


def _live_models(services: Services) -> list[str]:
    registry = services.registry
    return [name for name in registry.names() if registry.get(name) is not None and registry.live_workers(name)]


@router.get("/models", response_model=ModelList)
def list_models(services: ServicesDep) -> ModelList:
    """The models live workers serve, in OpenAI's list shape (GET /models has their details)."""
    return ModelList(data=[ModelCard(id=name) for name in _live_models(services)])


@router.get("/models/{model:path}", response_model=ModelCard, responses={404: {"description": "Unknown model"}})
def retrieve_model(model: str, services: ServicesDep) -> ModelCard:
    """One model live workers serve."""
    live = _live_models(services)
    if model not in live:
        served = ", ".join(live) or "none (is a worker running?)"
        raise OpenAIError(
            404, f"model {model!r} is not served here; served models: {served}", "model_not_found", param="model"
        )
    return ModelCard(id=model)


@router.api_route(
    "/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False, status_code=404
)
def no_such_route(path: str, request: Request) -> None:
    """Every other /v1 path, in OpenAI's error shape (an SDK shows the message, not only the
    status): a path served here with another method is a 405 naming the methods it takes."""
    here = f"/v1/{path}"
    methods = sorted(
        {
            m
            for route in router.routes
            if isinstance(route, APIRoute) and route.path_regex.match(here) and route.name != "no_such_route"
            for m in route.methods or ()
        }
    )
    if methods:
        raise OpenAIError(
            405, f"{request.method} {here} is not served; use {' or '.join(methods)}", "method_not_allowed"
        )
    served = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{model}"
    raise OpenAIError(404, f"no route {request.method} {here}; the OpenAI-compatible routes: {served}", "not_found")

"""OpenAI-compatible endpoints: `POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models`.

A chat completion request becomes an ordinary actq job (the same `JobRequest`, the same checks and
enqueue as `POST /jobs`: api/submit_checks.py, api/enqueue.py); the route then waits for the job
(async, on its Redis pub/sub channel) and answers in OpenAI's ChatCompletion shape, with an extra
`actq` field: the job id and the activations manifest exactly as `GET /jobs/{id}` renders it.

A (legacy) completion request goes the same way, as jobs with a raw `prompt`: the text is tokenized
as it is (the tokenizer's own BOS included), with no chat template, which is what base models and
probing on exact text need; a prompt of token ids is fed as given (nothing added; ids past the
vocabulary are a 400). The answer is OpenAI's Completion (`id` "cmpl-" + the first job's id,
`object: "text_completion"`), with the same `actq` field. `prompt` is a string, a list of strings, a
list of token ids or a list of such lists. Refused as for chat: penalties, logit bias; and the
completion's own `suffix` and `best_of` > 1. `echo: true` answers the prompt before the text: with
`max_tokens: 0` the prompt is only scored (a trace job, one forward pass); with generation,
`logprobs` covers the prompt's tokens then the generated ones, from the same prefill (the job's
`prompt_logprobs`). `max_tokens: 0` without `echo` is a 400.

Several prompts and `n` choices: every prompt and each of its `n` choices is its own job (its own
id, capture, record and activations file), all validated before any is queued and queued in one
transaction (as POST /jobs/batch); choice i of the answer is prompt i // n, choice i % n. Choice j
of a seeded request draws with seed + j. An Idempotency-Key covers them all (job i takes the key
with `#i`). The `x-actq-job-id` header lists the jobs' ids in choice order, comma-separated, and
`actq.choices[i]` holds job i's manifest. At most MAX_JOBS_PER_REQUEST jobs per request.

Log-probabilities: chat's `logprobs: true` and `top_logprobs` (0 to 20; without logprobs a 400)
answer `choices[0].logprobs` in OpenAI's chat shape (`content`: token, logprob, bytes,
top_logprobs); the legacy `logprobs: k` (0 to 20) answers OpenAI's legacy shape (`tokens`,
`token_logprobs`, `top_logprobs` of k entries per place or null for 0, `text_offset`). They are
the job's own (`result.logprobs` of GET /jobs/{id}): log_softmax of the raw logits, before
temperature and top_p. More entries than the worker holds inline (ACTQ_LOGPROBS_INLINE_TOKENS)
answer a 400 `logprobs_too_long` naming the job, whose activations file has them.

`stream: true` answers server-sent events in OpenAI's chunk format as the jobs generate, choices
interleaved by `index`, `actq` in the last chunk: api/openai/stream.py, which takes the request at
the start of each handler.

What is served and what is refused, field by field, is docs/feature-matrix.md; a field that is
not served is refused with a 400 naming it rather than silently ignored. `user` and `metadata`
are stored with the job (GET /jobs filters on them); `store`, `safety_identifier` and the
prompt-cache hints are accepted and ignored. A request without a `capture` may get the deployment's default one
(api/default_capture.py: ACTQ_DEFAULT_CAPTURE_BY_KEY, then ..._BY_MODEL). A
`developer` message is a `system` message; list content (`[{"type": "text", "text":
...}]`) is the concatenation of its text parts, with no separator. Two extra request fields:
`capture` (as in `POST /jobs`) and `actq_wait_seconds` (how long to wait for the job, default 300,
at most 3600; past it the answer is a 504 naming the job, which keeps running: poll
`GET /jobs/{id}`). An `Idempotency-Key` header works as for `POST /jobs`: resending a timed-out
request with the same key waits for the same job instead of queueing another.

Errors under /v1 use OpenAI's error shape (api/openai/errors.py says how); responses about a job
that ran (failed, cancelled, still running) carry `x-should-retry: false`, so that OpenAI's
clients do not resubmit it on their own: a retry would queue a new job. So does any error met while
waiting for a queued job (`wait_failed`, naming the job). The wait takes one of the process's
long-poll places (ACTQ_MAX_LONG_POLLS); when none is free the answer is a 429 with `Retry-After`
before anything is queued, which the client's own retry handles. Both completion endpoints, answered
or streamed, share this flow (api/openai/submit.py), so they cannot drift apart on it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

import redis
from anyio import to_thread
from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from api.bodies import body_schema, in_turn, is_large, parsed
from api.deps import CallerDep, Services, ServicesDep, get_caller
from api.errors import redis_trouble
from api.openai.errors import JOB_ID_HEADER, OpenAIError, from_actq, from_validation
from api.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from api.openai.requests import completion_job_requests, to_job_requests
from api.openai.responses import Shown, completion, text_completion
from api.openai.stream import stream_chat, stream_completion
from api.openai.submit import finished
from api.run_labels import labelled
from shared.errors import ActqError
from shared.schemas import JobRecord


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
    413: {"description": "Over a size limit (ACTQ_MAX_REQUEST_BYTES, ACTQ_MAX_SCHEMA_BYTES)"},
    404: {"description": "Unknown model"},
    429: {"description": "Every long-poll place of this API process is taken (Retry-After)"},
    500: {"description": "The job failed"},
    503: {},
    504: {"description": "The job did not finish in time"},
}


IdempotencyKey = Annotated[str | None, Header(min_length=1, max_length=256)]


async def _answer(records: list[JobRecord], build: Callable[[], BaseModel]) -> Response:
    """The answer, built and serialised on a thread: a reply with every prompt token's
    log-probabilities runs to megabytes, and building it on the event loop held every other
    request (/health waited up to a second behind one)."""
    body = await to_thread.run_sync(lambda: build().model_dump_json(by_alias=True).encode())
    answer = Response(body, media_type="application/json")
    _name_jobs(answer, records)
    return answer


def _name_jobs(response: Response, records: list[JobRecord]) -> None:
    """The jobs' ids in choice order, for clients that drop the body's `actq` field."""
    response.headers[JOB_ID_HEADER] = ",".join(record.id for record in records)


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses=ERRORS,
    openapi_extra=body_schema(ChatCompletionRequest),
)
async def chat_completions(
    body: Annotated[ChatCompletionRequest, parsed(ChatCompletionRequest)],
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    idempotency_key: IdempotencyKey = None,
) -> ChatCompletion | Response:
    """OpenAI's chat completion, run as actq jobs (one per choice, with an optional `capture`):
    answers once they have finished, with the job ids and activations manifests in the extra
    field `actq`; with `stream: true`, server-sent events as the job generates."""
    if body.stream or body.stream_options is not None:
        return await stream_chat(services, body, request, caller, idempotency_key)
    job_requests = labelled(request, await in_turn(request, services, caller, to_job_requests, body))
    records = await finished(
        services,
        job_requests,
        large=await is_large(request),
        wait_seconds=body.actq_wait_seconds,
        idempotency_key=idempotency_key,
        caller=caller,
    )
    return await _answer(records, lambda: completion(records, request, Shown.of(body)))


@router.post("/completions", response_model=Completion, responses=ERRORS, openapi_extra=body_schema(CompletionRequest))
async def completions(
    body: Annotated[CompletionRequest, parsed(CompletionRequest)],
    services: ServicesDep,
    caller: CallerDep,
    request: Request,
    idempotency_key: IdempotencyKey = None,
) -> Completion | Response:
    """OpenAI's (legacy) completion: each prompt (text, tokenized as it is with no chat template,
    or token ids) and each of its `n` choices run as an actq job (with an optional `capture`);
    answers like the chat completion, with the job ids and activations manifests in `actq`; with
    `stream: true`, server-sent events as the job generates."""
    if body.stream or body.stream_options is not None:
        return await stream_completion(services, body, request, caller, idempotency_key)
    job_requests = labelled(request, await in_turn(request, services, caller, completion_job_requests, body))
    records = await finished(
        services,
        job_requests,
        large=await is_large(request),
        wait_seconds=body.actq_wait_seconds,
        idempotency_key=idempotency_key,
        caller=caller,
    )
    return await _answer(records, lambda: text_completion(records, request, Shown.of(body)))


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

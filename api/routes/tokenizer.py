"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, in vLLM's shapes at the server
root (where lm-eval's RemoteTokenizer looks for them), answered by a live worker's own tokenizer:
the API holds none. Each request becomes a call on the model's Redis list and waits (at most
WAIT_SECONDS) for the reply of whichever worker takes it (worker/tokenizer_service.py).

`model` may be left out when live workers serve exactly one model (lm-eval sends none). Errors
are actq's (`{"error", "detail"}`): 404 for a model no live worker serves (as on /v1/models: a
model is served while a worker runs it), 422 for bad input (ids outside the vocabulary
included), 503 when a live-listed worker does not answer in time.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel

from api.bodies import INLINE_BYTES, body_schema, parsed
from api.deps import CallerDep, Services, ServicesDep, get_caller
from shared import keys
from shared.errors import ActqError, BadRequest, NoChatTemplate, NoWorkerAnswer, UnknownModel
from shared.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizerCall,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    TokenizerReply,
)

router = APIRouter(tags=["tokenizer"], dependencies=[Depends(get_caller)])
WAIT_SECONDS = 10.0  # for a worker's reply (normally milliseconds: the tokenizer does not queue behind jobs)
CALL_TTL_SECONDS = 60  # a model's call list outlives its last push by this much, taken or not
CONCURRENT_CALLS = 8  # waits per process: each holds a Redis connection while it waits
BLOCK_SECONDS = 2.0  # one BLPOP's wait: well under the async client's socket timeout (5 s)
_ERRORS: dict[str, type[ActqError]] = {"invalid_request": BadRequest, "no_chat_template": NoChatTemplate}
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()
ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "No live worker serves the model"},
    422: {},
    503: {"description": "No live worker answered in time"},
}


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    response_model_exclude_none=True,
    responses=ERRORS,
    openapi_extra=body_schema(TokenizeRequest),
)
async def tokenize(
    body: Annotated[TokenizeRequest, parsed(TokenizeRequest)], services: ServicesDep, caller: CallerDep
) -> TokenizeResponse | Response:
    """Text (`prompt`) or a chat (`messages`) to the model's token ids (vLLM's /tokenize)."""
    result, large = await _call(services, caller, body.model, "tokenize", tokenize=body)
    if large:  # a long text's ids (and token strings): validated and written off the event loop
        return await services.checks.run(caller, _json_response, TokenizeResponse, result)
    return TokenizeResponse.model_validate(result)


@router.post(
    "/detokenize", response_model=DetokenizeResponse, responses=ERRORS, openapi_extra=body_schema(DetokenizeRequest)
)
async def detokenize(
    body: Annotated[DetokenizeRequest, parsed(DetokenizeRequest)], services: ServicesDep, caller: CallerDep
) -> DetokenizeResponse | Response:
    """Token ids to text, special tokens included (vLLM's /detokenize)."""
    result, large = await _call(services, caller, body.model, "detokenize", detokenize=body)
    if large:
        return await services.checks.run(caller, _json_response, DetokenizeResponse, result)
    return DetokenizeResponse.model_validate(result)


def _json_response(shape: type[BaseModel], result: dict[str, Any]) -> Response:
    return Response(shape.model_validate(result).model_dump_json(exclude_none=True), media_type="application/json")


@router.get("/tokenizer_info", response_model=TokenizerInfo, responses=ERRORS)
async def tokenizer_info(
    services: ServicesDep, model: Annotated[str | None, Query(min_length=1, max_length=200)] = None
) -> TokenizerInfo:
    """The tokenizer's special tokens, lengths and chat template (a subset of vLLM's /tokenizer_info)."""
    result, _ = await _call(services, None, model, "info")
    return TokenizerInfo.model_validate(result)


async def _served(services: Services, model: str | None) -> str:
    """The model to ask: the one named, else the only one live workers serve."""
    counts = await services.registry.live_counts_async()
    live = sorted(name for name, count in counts.items() if count)
    if model is None:
        if len(live) == 1:
            return live[0]
        if live:
            raise BadRequest(f"several models are served here ({', '.join(live)}): name one in `model`")
        raise UnknownModel("no worker is serving a model now, so no tokenizer can answer; start a worker")
    if model not in counts:
        served = ", ".join(live) or "none (is a worker running?)"
        raise UnknownModel(f"model {model!r} is not served here; served models: {served}")
    if not counts[model]:
        raise UnknownModel(f"no worker of model {model!r} is live now, so its tokenizer cannot answer; start one")
    return model


async def _call(
    services: Services,
    caller: str | None,
    model: str | None,
    op: Literal["tokenize", "detokenize", "info"],
    tokenize: TokenizeRequest | None = None,
    detokenize: DetokenizeRequest | None = None,
) -> tuple[dict[str, Any], bool]:
    """Push the call for the model's workers and wait for the reply: its result, and whether the
    reply was large (parsed off the event loop, in `caller`'s turn: api/content_checks.py); or its
    error raised."""
    name = await _served(services, model)
    deadline = time.monotonic() + WAIT_SECONDS
    slots = _slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(CONCURRENT_CALLS))
    try:  # a burst waits here, not for the Redis pool's connections
        await asyncio.wait_for(slots.acquire(), WAIT_SECONDS)
    except TimeoutError:
        busy = f"this API process's tokenizer calls stayed busy for {WAIT_SECONDS:.0f} s; retry in a moment"
        raise NoWorkerAnswer(busy) from None
    try:
        remaining = max(deadline - time.monotonic(), 0.1)
        call = TokenizerCall(
            id=uuid.uuid4().hex, deadline=time.time() + remaining, op=op, tokenize=tokenize, detokenize=detokenize
        )
        async with services.aredis.pipeline(transaction=True) as pipe:
            pipe.rpush(keys.tokenizer_requests(name), call.model_dump_json(exclude_none=True))
            pipe.expire(keys.tokenizer_requests(name), CALL_TTL_SECONDS)
            await pipe.execute()
        popped = None
        while popped is None and (left := deadline - time.monotonic()) > 0:  # 0 would block for ever
            wait = min(max(left, 0.01), BLOCK_SECONDS)
            popped = await services.aredis.blpop([keys.tokenizer_reply(call.id)], timeout=wait)
    finally:
        slots.release()
    if popped is None:
        raise NoWorkerAnswer(f"no worker of model {name!r} answered within {WAIT_SECONDS:.0f} s; retry in a moment")
    large = len(popped[1]) > INLINE_BYTES
    if large:
        reply = await services.checks.run(caller, TokenizerReply.model_validate_json, popped[1])
    else:
        reply = TokenizerReply.model_validate_json(popped[1])
    if reply.error is not None:
        raise _ERRORS.get(reply.error.type, ActqError)(reply.error.message)
    return reply.result or {}, large

"""Calls to a live worker's tokenizer, for an API that holds none: the call is pushed onto the
model's Redis list and the reply of whichever worker takes it (worker/engine/tokenizer_service.py) is
awaited, at most WAIT_SECONDS. The tokenizer routes (api/routes/tokenizer.py) answer with it, and
the OpenAI routes count a long text prompt's tokens with it before queueing (api/context_check.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from typing import Any, Literal

from api.bodies import INLINE_BYTES
from api.deps import Services
from shared import keys
from shared.errors import ActqError, BadRequest, NoChatTemplate, NoWorkerAnswer, UnknownModel
from shared.tokenization import DetokenizeRequest, TokenizerCall, TokenizeRequest, TokenizerReply

WAIT_SECONDS = 10.0  # for a worker's reply (normally milliseconds: the tokenizer does not queue behind jobs)
CALL_TTL_SECONDS = 60  # a model's call list outlives its last push by this much, taken or not
CONCURRENT_CALLS = 8  # waits per process: each holds a Redis connection while it waits
BLOCK_SECONDS = 2.0  # one BLPOP's wait: well under the async client's socket timeout (5 s)
_ERRORS: dict[str, type[ActqError]] = {"invalid_request": BadRequest, "no_chat_template": NoChatTemplate}
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


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


async def tokenizer_call(
    services: Services,
    caller: str | None,
    model: str | None,
    op: Literal["tokenize", "detokenize", "info"],
    tokenize: TokenizeRequest | None = None,
    detokenize: DetokenizeRequest | None = None,
    wait: float = WAIT_SECONDS,
) -> tuple[dict[str, Any], bool]:
    """Push the call for the model's workers and wait for the reply: its result, and whether the
    reply was large (parsed off the event loop, in `caller`'s turn: api/check_pool.py); or its
    error raised."""
    name = await _served(services, model)
    deadline = time.monotonic() + wait
    slots = _slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(CONCURRENT_CALLS))
    try:  # a burst waits here, not for the Redis pool's connections
        await asyncio.wait_for(slots.acquire(), wait)
    except TimeoutError:
        busy = f"this API process's tokenizer calls stayed busy for {wait:g} s; retry in a moment"
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
            block = min(max(left, 0.01), BLOCK_SECONDS)
            popped = await services.aredis.blpop([keys.tokenizer_reply(call.id)], timeout=block)
    finally:
        slots.release()
    if popped is None:
        raise NoWorkerAnswer(f"no worker of model {name!r} answered within {wait:g} s; retry in a moment")
    large = len(popped[1]) > INLINE_BYTES
    if large:
        reply = await services.checks.run(caller, TokenizerReply.model_validate_json, popped[1])
    else:
        reply = TokenizerReply.model_validate_json(popped[1])
    if reply.error is not None:
        raise _ERRORS.get(reply.error.type, ActqError)(reply.error.message)
    return reply.result or {}, large

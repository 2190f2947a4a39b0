"""A text prompt over the model's context, refused by the OpenAI routes before anything is queued.

Submit refuses what cannot fit whatever the tokenizer does (token ids counted, text by its bytes:
shared/capture_spec.check_prompt_fits). A text between that lower bound and the context used to
be queued and then fail in the worker, where an OpenAI client sees a failed job, not a bad
request, and does not fall back to a model with a longer context. Here such a text is counted
by a live worker's tokenizer (api/tokenizer_calls.py, the /tokenize machinery) and refused
with a 400 `context_length_exceeded` in OpenAI's and vLLM's words (shared/errors.over_context).

It is cheap where it runs: only a text whose bytes (an upper bound on its tokens, plus a margin
for the chat template) could overflow is counted, one call per distinct prompt of the request.
Tools rendered into a chat are left out of the count, so a count that fits may still overflow in
the worker, which checks again with every token; a count that overflows always does. When no
worker answers in time (or Redis fails the call), nothing is refused here and the worker decides.
"""

from __future__ import annotations

import logging

import redis

from api.deps import Services
from api.tokenizer_calls import tokenizer_call
from shared.errors import ActqError, LogprobsTooLong, PromptTooLong, over_context
from shared.schemas import JobRequest
from shared.tokenization import TokenizeRequest

log = logging.getLogger("actq.api")
COUNT_WAIT_SECONDS = 2.0  # for the count: a live worker answers in milliseconds; the worker counts anyway
TEMPLATE_TOKENS = 256  # a chat template's own tokens, at most (a default system prompt included)
MESSAGE_TOKENS = 16  # and per message (its role and turn markers)


def may_overflow(request: JobRequest, context: int, max_tokens: int) -> bool:
    """Whether the request's text could hold more tokens than `context` leaves beside
    `max_tokens`: a token stands for at least one byte."""
    if request.prompt_token_ids is not None or not context:
        return False
    most = request.content_bytes
    if request.messages is not None:
        most += TEMPLATE_TOKENS + MESSAGE_TOKENS * len(request.messages)
    return most + max_tokens > context


def scores_prompt_past(request: JobRequest, limit: int) -> bool:
    """Whether the request's prompt may hold more log-probability entries than `limit` (vLLM's
    `prompt_logprobs`, a scored trace): each of its tokens but the first gets one."""
    if not (request.prompt_logprobs or (request.trace and request.logprobs)):
        return False
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids) - 1 > limit
    return may_overflow(request, limit + 1, 0)


async def refuse_overflow(services: Services, caller: str | None, requests: list[JobRequest]) -> None:
    """PromptTooLong when a request's text cannot fit its model's context beside its max_tokens
    (module docstring), and LogprobsTooLong when its prompt's log-probabilities alone are more than
    a response holds (ACTQ_LOGPROBS_INLINE_TOKENS: they would be scored, then refused); the
    requests of one OpenAI call share their prompts (n choices)."""
    counted: dict[str, int] = {}
    inline = services.settings.logprobs_inline_tokens
    for request in requests:
        info = await services.registry.get_async(request.model)
        if info is None:
            continue  # submit says the model is unknown
        max_tokens = 0 if request.trace else request.max_tokens or services.settings.max_tokens_default
        scored = scores_prompt_past(request, inline)
        overflows = may_overflow(request, info.max_context, max_tokens)
        if not (overflows or scored) or request.continue_final_message:
            continue  # a continued message renders shorter than /tokenize counts it: the worker decides
        if request.chat_template_kwargs:
            continue  # variables /tokenize does not take: the worker counts with them
        if request.prompt_token_ids is not None:
            prompt = len(request.prompt_token_ids)
        else:
            key = request.model_dump_json(include={"model", "prompt", "messages", "add_generation_prompt"})
            if key not in counted:
                tokenize = TokenizeRequest(
                    model=request.model,
                    prompt=request.prompt,
                    messages=request.messages,
                    add_generation_prompt=None if request.messages is None else request.generation_prompt,
                )
                try:
                    result, _ = await tokenizer_call(
                        services, caller, request.model, "tokenize", tokenize=tokenize, wait=COUNT_WAIT_SECONDS
                    )
                except ActqError as exc:  # no worker answered, or its tokenizer refused: the worker decides
                    log.info("not counting a long prompt's tokens before queueing it: %s", exc.message)
                    return
                except redis.RedisError as exc:  # submitting meets Redis next, and answers for it
                    log.info("not counting a long prompt's tokens before queueing it: Redis: %r", exc)
                    return
                counted[key] = int(result["count"])
            prompt = counted[key]
        what = "messages" if request.messages is not None else "prompt"
        if prompt + max_tokens > info.max_context:
            raise PromptTooLong(over_context(info.max_context, prompt, max_tokens, what))
        if scored and prompt - 1 > inline:
            raise LogprobsTooLong(
                f"your {what} holds {prompt} tokens, so its log-probabilities (prompt_logprobs) would be {prompt - 1} "
                f"entries, more than a response holds (ACTQ_LOGPROBS_INLINE_TOKENS={inline}): send a shorter {what}, "
                "or submit it as a job (POST /jobs with prompt_logprobs) and read them from its activations file"
            )

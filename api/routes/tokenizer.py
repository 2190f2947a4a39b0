"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, in vLLM's shapes at the server
root (where lm-eval's RemoteTokenizer looks for them), answered by a live worker's own tokenizer:
the API holds none. Each request becomes a call on the model's Redis list and waits (at most
WAIT_SECONDS) for the reply of whichever worker takes it (worker/engine/tokenizer_service.py).

`model` may be left out when live workers serve exactly one model (lm-eval sends none). Errors
are actq's (`{"error", "detail"}`): 404 for a model no live worker serves (as on /v1/models: a
model is served while a worker runs it), 422 for bad input (ids outside the vocabulary
included), 503 when a live-listed worker does not answer in time.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel

from api.bodies import body_schema, parsed
from api.deps import CallerDep, ServicesDep, get_caller
from api.tokenizer_calls import tokenizer_call
from shared.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)

router = APIRouter(tags=["tokenizer"], dependencies=[Depends(get_caller)])
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
    result, large = await tokenizer_call(services, caller, body.model, "tokenize", tokenize=body)
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
    result, large = await tokenizer_call(services, caller, body.model, "detokenize", detokenize=body)
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
    result, _ = await tokenizer_call(services, None, model, "info")
    return TokenizerInfo.model_validate(result)

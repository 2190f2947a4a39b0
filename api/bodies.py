"""Request bodies parsed and validated off the event loop when they are large.

FastAPI parses a declared body on the event loop (`json.loads`, then pydantic): for a body near
ACTQ_MAX_REQUEST_BYTES that held the loop, and every other request of the process, for 100-400 ms
(4 MiB of small messages, stop strings or token ids). The routes that take large bodies (jobs,
batches, the OpenAI routes) declare theirs as `Annotated[Model, parsed(Model)]` instead: a body up to
INLINE_BYTES is validated on the loop as before (a millisecond or two, no thread hop); a larger
one is parsed and validated on one of the check-pool threads, in the caller's turn
(api/check_pool.py), so one key's large bodies wait for each other, not for anyone else's.
Every list a body may hold has a bound its model states, checked as it is validated, so what a
large body costs is its parse (C, holding the GIL: the threads cannot hide it, the body limit
bounds it) plus validation bounded by the counts. Errors are FastAPI's own: a
RequestValidationError, located under `body`.

The OpenAPI schema still describes the body: each such route carries `body_schema(Model)` as its
`openapi_extra`, and `document_bodies` adds the models' schemas to the components (named
`<Model>-Input`, FastAPI's own name for a model's validation schema).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pydantic_core
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from api.deps import CallerDep, Services, ServicesDep

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

INLINE_BYTES = 64 << 10  # bodies up to this size are validated on the event loop (about 1-2 ms)
REF = "#/components/schemas/{model}-Input"
_DOCUMENTED: list[type[BaseModel]] = []


def parsed(model: type[M]) -> Any:
    """The dependency behind `Annotated[Model, parsed(Model)]`: the route's body, validated as the
    module docstring says."""

    async def parse(request: Request, services: ServicesDep, caller: CallerDep) -> M:
        raw = await request.body()
        try:
            if len(raw) <= INLINE_BYTES:
                return model.model_validate_json(raw)
            return await services.checks.run(caller, _validate, model, raw)
        except ValidationError as exc:
            errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None

    parse.__name__ = f"parse_{model.__name__}"
    return Depends(parse)


async def is_large(request: Request) -> bool:
    """Whether the request's body (read already, so this costs nothing) is over INLINE_BYTES: its
    route then does what scales with it (translating, checking, submitting) off the event loop."""
    return len(await request.body()) > INLINE_BYTES


async def in_turn(request: Request, services: Services, caller: str | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a check-pool thread in `caller`'s turn when the body is large, else here."""
    if await is_large(request):
        return await services.checks.run(caller, fn, *args)
    return fn(*args)


def _validate(model: type[M], raw: bytes) -> M:
    """A large body: parsed (jiter, as `model_validate_json` parses), then validated from Python
    objects, where a list over its `max_length` is refused at its first extra item instead of
    after all of them (4 MiB of messages: 0.3 ms instead of 94 ms of validation). Parsing holds
    the GIL, about 9 ms per MB of small objects: the body limit bounds it."""
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        error = {"type": "json_invalid", "loc": ("body",), "msg": f"Invalid JSON: {exc}", "input": {}}
        raise RequestValidationError([error]) from None
    return model.model_validate(data)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route whose body is `parsed(model)`."""
    if model not in _DOCUMENTED:
        _DOCUMENTED.append(model)
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def document_bodies(app: FastAPI) -> None:
    """The app's OpenAPI schema as FastAPI writes it, plus the components of the parsed bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            _, defs = models_json_schema([(m, "validation") for m in _DOCUMENTED], ref_template=REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(f"{name}-Input", definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

"""Request bodies parsed and validated off the event loop when they are large.

FastAPI parses a declared body on the event loop (`json.loads`, then pydantic): for a body near
ACTQ_MAX_REQUEST_BYTES that held the loop, and every other request of the process, for 100-400 ms
(4 MiB of small messages, stop strings or token ids). The routes that take large bodies (jobs,
batches, the OpenAI routes) declare theirs as `Annotated[Model, parsed(Model)]` instead: a body up to
INLINE_BYTES is validated on the loop as before (a millisecond or two, no thread hop); a larger
one is validated by pydantic's own JSON parser on one of the content-check threads, in the
caller's turn (api/content_checks.py), so one key's large bodies wait for each other, not for
anyone else's. Errors are FastAPI's own: a RequestValidationError, located under `body`.

The OpenAPI schema still describes the body: each such route carries `body_schema(Model)` as its
`openapi_extra`, and `document_bodies` adds the models' schemas to the components (named
`<Model>-Input`, FastAPI's own name for a model's validation schema).
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from api.deps import CallerDep, ServicesDep

M = TypeVar("M", bound=BaseModel)

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
            return await services.checks.run(caller, model.model_validate_json, raw)
        except ValidationError as exc:
            errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
            raise RequestValidationError(errors) from None

    parse.__name__ = f"parse_{model.__name__}"
    return Depends(parse)


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

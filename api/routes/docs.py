"""The API's schema and docs behind a key: mounted instead of FastAPI's open ones when API keys
are on (unless ACTQ_PUBLIC_DOCS). A browser cannot send the key with Swagger's own fetch of the
schema; use ACTQ_PUBLIC_DOCS=true on a trusted network, or read /openapi.json with the key."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from api.deps import get_caller

router = APIRouter(include_in_schema=False, dependencies=[Depends(get_caller)])


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")

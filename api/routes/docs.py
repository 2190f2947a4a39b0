"""The API's docs pages, /docs (Swagger UI) and /redoc (ReDoc), with their JavaScript, CSS and icon
served by the app itself under ASSETS (FastAPI's "self-hosting JavaScript and CSS for docs" recipe,
with the files the `fastapi-offline` package ships): the pages render with no internet.

Open (`open_router`) when API keys are off or ACTQ_PUBLIC_DOCS is on; otherwise behind a key
(`router`, with /openapi.json). A browser cannot send the key with Swagger's own fetch of the
schema; use ACTQ_PUBLIC_DOCS=true on a trusted network, or read /openapi.json with the key. The
assets are public either way: they are the same files for every deployment, and a <script> tag
cannot send a key either."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from api.deps import get_caller

ASSETS = "/docs-assets"
SWAGGER_JS, SWAGGER_CSS = f"{ASSETS}/swagger-ui-bundle.js", f"{ASSETS}/swagger-ui.css"
REDOC_JS, FAVICON = f"{ASSETS}/redoc.standalone.js", f"{ASSETS}/favicon.png"


def assets() -> StaticFiles:
    """The Swagger UI, ReDoc and icon files, as the app mounts them at ASSETS."""
    return StaticFiles(directory=str(files("fastapi_offline") / "static"))


async def swagger(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title=f"{request.app.title} - docs",
        swagger_js_url=root + SWAGGER_JS,
        swagger_css_url=root + SWAGGER_CSS,
        swagger_favicon_url=root + FAVICON,
        oauth2_redirect_url=None,
    )


async def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(
        openapi_url=f"{root}/openapi.json",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=root + REDOC_JS,
        redoc_favicon_url=root + FAVICON,
        with_google_fonts=False,
    )


async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


open_router = APIRouter(include_in_schema=False)
router = APIRouter(include_in_schema=False, dependencies=[Depends(get_caller)])
for _router in (open_router, router):
    _router.add_api_route("/docs", swagger, methods=["GET"])
    _router.add_api_route("/redoc", redoc, methods=["GET"])
router.add_api_route("/openapi.json", openapi, methods=["GET"])

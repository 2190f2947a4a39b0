"""`uvicorn api.main:app`: the app factory and the app it builds from the environment's settings."""

from __future__ import annotations

import sys

from fastapi import FastAPI

from api import errors, run_labels
from api.bodies import document_bodies
from api.deps import build_services
from api.limits import BodyLimit
from api.routes import activations, docs, health, jobs, metrics, models, nnsight, openai, tokenizer, vectors
from shared.settings import Settings, get_settings

GIL_TURN_SECONDS = 0.001


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    # The event loop waits for the GIL at every wake-up while a content check runs on a thread
    # (api/check_pool.py): CPython's default 5 ms turn made each wake-up of a /health request
    # wait up to 5 ms, several times; 1 ms turns cut /health's p99 under such load by about half.
    sys.setswitchinterval(GIL_TURN_SECONDS)
    open_docs = settings.public_docs or not settings.api_key_list
    app = FastAPI(
        title="actq",
        summary="Chat completions with per-token activation capture, queued for one-model workers.",
        version="0.1.0",
        docs_url=None,  # api/routes/docs.py serves /docs and /redoc, with their files (no CDN)
        redoc_url=None,
        openapi_url="/openapi.json" if open_docs else None,
    )
    app.state.services = build_services(settings)
    # a vector set upload has its own limit, and its refusal names it (the route checks it too)
    uploads = {
        "/vectors": (settings.vector_max_bytes, vectors.too_large(settings.vector_max_bytes)),
        # an nnsight payload, plus its form's envelope and boundaries
        "/request": (
            settings.nnsight_max_request_bytes + 200_000,
            nnsight.too_large(settings.nnsight_max_request_bytes),
        ),
    }
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, paths=uploads)
    errors.install(app)
    app.include_router(jobs.router)
    app.include_router(activations.router)
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(openai.router)
    app.include_router(openai.router, prefix=run_labels.PREFIX, include_in_schema=False)  # a run's jobs tagged
    app.include_router(vectors.router)
    app.include_router(tokenizer.router)
    app.include_router(tokenizer.router, prefix=run_labels.PREFIX, include_in_schema=False)  # beside its /v1
    app.include_router(nnsight.router)
    app.include_router(docs.open_router if open_docs else docs.router)
    app.mount(docs.ASSETS, docs.assets(), name="docs-assets")
    document_bodies(app)
    return app


app = create_app()

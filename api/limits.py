"""A limit on request bodies, enforced before anything parses them: a declared Content-Length over
the limit is refused at once, and a body without one is counted as it streams in. And the 429 of
the per-key limits on queued jobs and bytes (kept by the job store, atomically with enqueueing)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import Busy


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuses a request body over `max_bytes` (`paths`: a larger limit for routes under those
    path prefixes, such as a vector set upload, which enforces its own)."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = next((most for prefix, most in self.paths.items() if path == prefix), self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": "request_too_large",
                "detail": f"the request body is over {self.max_bytes:,} bytes (ACTQ_MAX_REQUEST_BYTES)",
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class QuotaExceeded(Busy):
    """An API key's queued jobs or bytes at their limit (ACTQ_MAX_QUEUED_*_PER_KEY): 429, nothing
    queued; retrying makes sense once some of its jobs have finished."""

    error_type = "quota_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=5)

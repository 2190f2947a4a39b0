"""A limit on request bodies, enforced before anything parses them: a declared Content-Length over
the limit is refused at once, and a body without one is counted as it streams in. And the 429 of
the per-key limits on queued jobs and bytes (kept by the job store, atomically with enqueueing)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import ActqError, Busy


class BodyTooLarge(Exception):
    pass


class RequestTooLarge(ActqError):
    """A request body over ACTQ_MAX_REQUEST_BYTES: 413, before anything parses it."""

    status_code = 413
    error_type = "request_too_large"


class BodyLimit:
    """Refuses a request body over `max_bytes` (`paths`: another limit for those paths, with the
    refusal that names its own setting, such as a vector set upload's ACTQ_VECTOR_MAX_BYTES)."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: Mapping[str, tuple[int, ActqError]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}
        self.default = RequestTooLarge(f"the request body is over {max_bytes:,} bytes (ACTQ_MAX_REQUEST_BYTES)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, refusal = self.paths.get(scope.get("path", ""), (self.max_bytes, self.default))
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(send, refusal)
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
            await self._refuse(send, refusal)

    async def _refuse(self, send: Send, refusal: ActqError) -> None:
        body = json.dumps({"error": refusal.error_type, "detail": refusal.message}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": refusal.status_code,
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

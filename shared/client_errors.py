"""The Python client's errors: `ActqClientError` (HTTP status, the API's `error` type and
`detail`) and a subclass per kind of answer, and the check that turns an error answer into one.

    ActqClientError
    ├── BadRequest      400, 422
    ├── NotFound        404
    ├── Conflict        409
    ├── Busy            429
    ├── Unavailable     503
    ├── JobFailed       the job ended failed or cancelled
    └── ChecksumMismatch  a download differs from its manifest
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from shared.retries import retry_after

if TYPE_CHECKING:  # pragma: no cover
    from shared.client_jobs import Job


class ActqClientError(Exception):
    """An error answered by the API (or found by the client): HTTP status, the API's `error`
    type and its `detail` message."""

    def __init__(self, status_code: int | None, error_type: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(status_code, error_type, detail)
        self.status_code = status_code
        self.error_type = error_type
        self.detail = detail
        self.retry_after = retry_after  # seconds, from the answer's Retry-After header

    def __str__(self) -> str:
        status = f"{self.status_code} " if self.status_code is not None else ""
        return f"{status}{self.error_type}: {self.detail}"


class BadRequest(ActqClientError):
    """400/422: the request cannot be run as given (nothing was enqueued)."""


class NotFound(ActqClientError):
    """404: unknown job or model, or no activations for that job."""


class Conflict(ActqClientError):
    """409: e.g. the activations of a job that has not succeeded."""


class Unavailable(ActqClientError):
    """503: the API cannot reach Redis (`service_unavailable`) or its object store
    (`storage_error`); retried, then raised once the retry budget is spent."""


class Busy(ActqClientError):
    """429: a capacity limit of the API (e.g. its long polls); retry after a pause."""


class JobFailed(ActqClientError):
    """The job ended `failed` or `cancelled`. `error_type` is the job's `error.type`
    (e.g. `context_length_exceeded`, or `cancelled`), `detail` its message, `job` the job."""

    def __init__(self, job: Job, error_type: str, detail: str) -> None:
        super().__init__(None, error_type, detail)
        self.job = job


class ChecksumMismatch(ActqClientError):
    """The downloaded activations do not match the sha256 or size in the job's manifest."""


_BY_STATUS = {400: BadRequest, 422: BadRequest, 404: NotFound, 409: Conflict, 429: Busy, 503: Unavailable}


def raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    response.read()
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        error_type, detail = str(body["error"]), str(body.get("detail", ""))
    else:  # not the API's error shape (a proxy, or /health's 503 body)
        error_type, detail = f"http_{response.status_code}", response.text[:1000] or response.reason_phrase
    error = _BY_STATUS.get(response.status_code, ActqClientError)
    raise error(response.status_code, error_type, detail, retry_after(response))

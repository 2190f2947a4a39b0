"""Errors under /v1, in OpenAI's shape, because that is where OpenAI's clients look for the message:
`{"error": {"message", "type", "param", "code"}}` (`code` is actq's error type), plus `detail` (the
same message, as in every actq error) and, when a job exists, `error.job_id` and the job-id header.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis
from fastapi.responses import JSONResponse

from api.errors import invalid_json, where
from shared.errors import (
    ActqError,
    BadRequest,
    Busy,
    CaptureSpecError,
    CaptureTooLarge,
    InterventionError,
    InvalidSchema,
    NotReady,
    UnknownModel,
)
from shared.schemas import (
    JobRecord,
    JobStatus,
)

if TYPE_CHECKING:
    pass

# A failed job's error type -> HTTP status. Only a prompt too long for the model is the client's doing.
FAILURE_STATUS = {"context_length_exceeded": 400}


# Every OpenAI-compatible answer about a job names it here too: clients that drop the body's
# extra `actq` field (LangChain, lm-eval) still see which job holds the activations.
JOB_ID_HEADER = "x-actq-job-id"


class OpenAIError(Exception):
    """An error answered in OpenAI's shape (see the module docstring)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        job_id: str | None = None,
        retry: bool | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.status, self.message, self.code, self.param, self.job_id, self.retry = (
            status,
            message,
            code,
            param,
            job_id,
            retry,
        )

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error: dict[str, Any] = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        if self.job_id is not None:
            error["job_id"] = self.job_id
        headers = {} if self.retry is None else {"x-should-retry": "true" if self.retry else "false"}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.job_id is not None:
            headers[JOB_ID_HEADER] = self.job_id
        return JSONResponse({"error": error, "detail": self.message}, status_code=self.status, headers=headers or None)


def unsupported(field: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, "unsupported_parameter", param=field)


# endpoint -> whose fields it takes, for the message about an unknown field
ENDPOINT_FIELDS = {"/v1/chat/completions": "chat completion", "/v1/completions": "completion"}


def from_validation(errors: Sequence[Mapping[str, Any]], endpoint: str = "/v1/chat/completions") -> OpenAIError:
    if (problem := invalid_json(errors)) is not None:
        return OpenAIError(400, problem, "invalid_json")
    messages = []
    for e in errors:
        place = where(tuple(e.get("loc", ())))
        if e.get("type") == "extra_forbidden":
            fields = ENDPOINT_FIELDS.get(endpoint, "request")
            messages.append(
                f"unknown field {place!r}: {endpoint} takes OpenAI's {fields} fields "
                "plus 'capture' and 'actq_wait_seconds'"
            )
        else:
            messages.append(f"{place}: {e.get('msg')}")
    param = where(tuple(errors[0].get("loc", ()))) if errors else None
    return OpenAIError(400, "; ".join(messages), "invalid_request", param=param)


def from_actq(exc: ActqError) -> OpenAIError:
    if isinstance(exc, UnknownModel):
        return OpenAIError(404, exc.message, "model_not_found", param="model")
    if isinstance(exc, BadRequest):  # 422 under /jobs; OpenAI's clients expect 400 for a bad request
        param = "capture" if isinstance(exc, (CaptureSpecError, CaptureTooLarge)) else None
        param = "interventions" if isinstance(exc, InterventionError) else param
        param = exc.field if isinstance(exc, InvalidSchema) else param
        return OpenAIError(400, exc.message, exc.error_type, param=param)
    if isinstance(exc, Busy):  # nothing was queued: the client's own retry (after Retry-After) is right
        return OpenAIError(429, exc.message, "rate_limit_exceeded", retry_after=exc.retry_after)
    # OpenAI's clients retry a 409 by themselves: right for NotReady ("retry shortly"), pointless otherwise.
    retry = isinstance(exc, NotReady) if exc.status_code == 409 else None
    return OpenAIError(exc.status_code, exc.message, exc.error_type, retry=retry)


def after_queued(job_id: str, exc: Exception) -> OpenAIError:
    """An error met once the job is queued (Redis lost while waiting): never retried by the
    client on its own, since a retry would queue a second job; the message names the job."""
    status = 503 if isinstance(exc, redis.RedisError) else 500
    reason = "Redis (the job store) could not be reached" if status == 503 else f"{type(exc).__name__}"
    message = f"job {job_id} is queued and keeps running, but waiting for it failed ({reason}): poll GET /jobs/{job_id}"
    return OpenAIError(status, message, "wait_failed", job_id=job_id, retry=False)


def unfinished(record: JobRecord, waited: float, idempotency_key: str | None) -> OpenAIError:
    job_id = record.id
    if record.status is JobStatus.failed:
        error = record.error
        kind, text = (error.type, error.message) if error is not None else ("internal_error", "no reason recorded")
        return OpenAIError(
            FAILURE_STATUS.get(kind, 500), f"job {job_id} failed: {text}", kind, job_id=job_id, retry=False
        )
    if record.status is JobStatus.cancelled:
        return OpenAIError(409, f"job {job_id} was cancelled", "cancelled", job_id=job_id, retry=False)
    message = (
        f"job {job_id} has not finished after {waited:g} s (it is {record.status.value}) and keeps running: "
        f"poll GET /jobs/{job_id}?wait=60, or resend this request with the same Idempotency-Key to wait for it again"
    )
    # With an Idempotency-Key a client retry waits for the same job; without one it would queue another.
    return OpenAIError(504, message, "wait_timeout", job_id=job_id, retry=idempotency_key is not None)

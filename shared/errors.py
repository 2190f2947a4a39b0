"""One error hierarchy for the whole project.

    ActqError                  (500)  base: message + status code
    ├── BadRequest             (422)  the request cannot be run as given
    │   ├── CaptureSpecError   (422)  a capture path, hook or position is invalid
    │   └── CaptureTooLarge    (422)  the estimated capture exceeds the budget
    ├── Unauthorized           (401)  a missing or wrong API key
    ├── UnknownModel           (404)  no worker has ever served this model
    ├── JobNotFound            (404)
    ├── TensorNotFound         (404)  the job exists; the tensor name does not
    ├── Conflict               (409)  e.g. an Idempotency-Key reused for another request
    ├── NotReady               (409)  e.g. activations of a job that has not succeeded
    └── JobFailure                    raised inside the worker; stored on the job as {type, message}
        ├── ContextLengthExceeded
        ├── StorageError
        ├── JobTimeout
        ├── OutOfMemory
        └── InternalError      anything unexpected: "<ExceptionType>: <message>"

The API renders every ActqError as `{"error": <ClassName>, "detail": <message>}`.
"""

from __future__ import annotations


class ActqError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ActqError):
    status_code = 422
    error_type = "invalid_request"


class CaptureSpecError(BadRequest):
    error_type = "invalid_capture"


class CaptureTooLarge(BadRequest):
    error_type = "capture_too_large"


class Unauthorized(ActqError):
    status_code = 401
    error_type = "unauthorized"


class UnknownModel(ActqError):
    status_code = 404
    error_type = "unknown_model"


class JobNotFound(ActqError):
    status_code = 404
    error_type = "job_not_found"


class TensorNotFound(ActqError):
    status_code = 404
    error_type = "tensor_not_found"


class Conflict(ActqError):
    status_code = 409
    error_type = "conflict"


class NotReady(ActqError):
    status_code = 409
    error_type = "not_ready"


class JobFailure(ActqError):
    """A job ended in failure; `error_type` becomes the job's `error.type`."""

    error_type = "job_failed"


class ContextLengthExceeded(JobFailure):
    error_type = "context_length_exceeded"


class StorageError(JobFailure):
    status_code = 503  # when the API meets it: the store is unusable right now
    error_type = "storage_error"


class JobTimeout(JobFailure):
    error_type = "timeout"


class OutOfMemory(JobFailure):
    error_type = "out_of_memory"


class InternalError(JobFailure):
    error_type = "internal_error"

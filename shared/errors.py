"""One error hierarchy for the whole project.

    ActqError                  (500)  base: message + status code + error type
    ├── BadRequest             (422)  the request cannot be run as given
    │   ├── CaptureSpecError   (422)  a capture path, hook or position is invalid
    │   ├── CaptureTooLarge    (422)  the estimated capture exceeds the budget
    │   ├── JobTooLarge        (422)  the worker memory a job needs exceeds the budget
    │   ├── PromptTooLong      (422)  the prompt cannot fit the model's context (context_length_exceeded)
    │   ├── InvalidSchema      (422)  a tool's parameters or a response_format schema (names the field)
    │   └── InvalidVectors     (422)  an uploaded vector set is not a usable safetensors file
    ├── Unauthorized           (401)  a missing or wrong API key
    ├── Forbidden              (403)  a valid key that may not do this (operator-only)
    ├── UnknownModel           (404)  no worker has ever served this model
    ├── NoWorkerAnswer         (503)  no live worker answered in time (POST /tokenize and the like)
    ├── JobNotFound            (404)
    ├── TensorNotFound         (404)  the job exists; the tensor name does not
    ├── VectorSetNotFound      (404)  no such vector set, or another key's (never told apart)
    ├── PayloadTooLarge        (413)  over a size limit (ACTQ_VECTOR_MAX_BYTES, ACTQ_MAX_SCHEMA_BYTES)
    ├── Conflict               (409)  e.g. an Idempotency-Key reused for another request
    ├── Busy                   (429)  a capacity limit (long polls per process); carries Retry-After
    │   └── TooManyVectorSets  (429)  an API key holds ACTQ_MAX_VECTOR_SETS_PER_KEY vector sets
    ├── NotReady               (409)  e.g. activations of a job that has not succeeded
    ├── UnreadableRecord       (409)  a job's record holds values a newer version wrote (names them)
    ├── JobFailure                    job_failed: what the job asked for cannot run (an edit that cannot
    │   │                             apply, a grammar that does not compile); stored as {type, message}
    │   ├── ContextLengthExceeded     context_length_exceeded
    │   ├── StorageError       (503)  storage_error (the API answers 503 when it meets one)
    │   ├── JobTimeout                timeout
    │   ├── OutOfMemory               out_of_memory
    │   ├── WorkerLost                worker_lost: delivered ACTQ_MAX_ATTEMPTS times, never finished
    │   ├── UnsupportedByWorker       unsupported_by_worker: a record the worker's version cannot fully read
    │   ├── JobCancelled              cancelled: DELETE /jobs/{id} (the job ends `cancelled`)
    │   └── InternalError             internal_error: anything unexpected, "<ExceptionType>: <message>"
    ├── ConfigurationError            settings that cannot work together (a worker refuses to start)
    └── ToolError                     bad input to a command-line tool (`actq gsm8k`, `actq probe`)

The API renders every ActqError as `{"error": <error_type>, "detail": <message>}`, plus its
`extra()` where it has more to say; the `actq` command prints a ToolError's message and exits 2.
Every `error.type` a job can carry is the `error_type` of one JobFailure class:
`JobFailure.stored_types()` lists them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.newer_records import RecordCore


class ActqError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def extra(self) -> dict[str, object]:
        """Fields of the error's body besides `error` and `detail` (JSON values)."""
        return {}


class BadRequest(ActqError):
    status_code = 422
    error_type = "invalid_request"


class CaptureSpecError(BadRequest):
    error_type = "invalid_capture"


class InterventionError(BadRequest):
    error_type = "invalid_intervention"


class CaptureTooLarge(BadRequest):
    error_type = "capture_too_large"


class JobTooLarge(BadRequest):
    error_type = "job_too_large"


class PromptTooLong(BadRequest):
    error_type = "context_length_exceeded"


class LogprobsTooLong(BadRequest):
    """More log-probability entries than a response holds (ACTQ_LOGPROBS_INLINE_TOKENS)."""

    error_type = "logprobs_too_long"


class InvalidSchema(BadRequest):
    """A JSON Schema of the request (`field`: e.g. "tools[0].function.parameters") that cannot be
    checked or enforced: too deep, not a JSON Schema, refused by the grammar compiler, or
    allowing no value."""

    error_type = "invalid_schema"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NoChatTemplate(BadRequest):
    error_type = "no_chat_template"


class InvalidVectors(BadRequest):
    error_type = "invalid_vectors"


class Unauthorized(ActqError):
    status_code = 401
    error_type = "unauthorized"


class Forbidden(ActqError):
    status_code = 403
    error_type = "forbidden"


class UnknownModel(ActqError):
    status_code = 404
    error_type = "unknown_model"


class NoWorkerAnswer(ActqError):
    """What only a running worker can answer (its tokenizer): a worker is listed live, but none
    answered in time (hung, or just gone)."""

    status_code = 503
    error_type = "no_worker_answer"


class JobNotFound(ActqError):
    status_code = 404
    error_type = "job_not_found"


class TensorNotFound(ActqError):
    status_code = 404
    error_type = "tensor_not_found"


class VectorSetNotFound(ActqError):
    """Also another API key's set: the same answer, so a set's existence is never disclosed."""

    status_code = 404
    error_type = "vector_set_not_found"


class PayloadTooLarge(ActqError):
    status_code = 413
    error_type = "payload_too_large"


class Conflict(ActqError):
    status_code = 409
    error_type = "conflict"


class NotReady(ActqError):
    status_code = 409
    error_type = "not_ready"


class UnreadableRecord(ActqError):
    """A job's stored record holds values this version does not know (a newer version wrote it:
    shared/newer_records.py). `job`: what could be read of it, as stored; `unreadable`: each field
    that could not, as {field, value, problem}; `owner`: its owner's key id (None: none, or not
    readable); `core`: the record's id, state, model, owner and creation time when those could be
    read (a RecordCore), else None."""

    status_code = 409
    error_type = "unreadable_record"

    def __init__(
        self,
        message: str,
        job: dict[str, object],
        unreadable: list[dict[str, str]],
        owner: str | None = None,
        core: RecordCore | None = None,
    ) -> None:
        super().__init__(message)
        self.job, self.unreadable, self.owner, self.core = job, unreadable, owner, core

    def extra(self) -> dict[str, object]:
        return {"job": self.job, "unreadable": self.unreadable}


class Busy(ActqError):
    """Capacity, not the request: retry after `retry_after` seconds (sent as Retry-After)."""

    status_code = 429
    error_type = "busy"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyVectorSets(Busy):
    """An API key's vector sets at ACTQ_MAX_VECTOR_SETS_PER_KEY: room comes only from deleting
    some (sets never expire), so Retry-After is long."""

    error_type = "too_many_vector_sets"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=60)


class JobFailure(ActqError):
    """A job ended badly; `error_type` becomes the job's `error.type`."""

    error_type = "job_failed"

    def as_error(self) -> dict[str, str]:
        """The `{type, message}` stored on the job."""
        return {"type": self.error_type, "message": self.message}

    @classmethod
    def stored_types(cls) -> set[str]:
        """Every `error.type` a job can end with: this class's own (JobFailure itself is raised,
        as `job_failed`) and its subclasses'."""
        found = {cls.error_type}
        for sub in cls.__subclasses__():
            found |= sub.stored_types()
        return found


class ContextLengthExceeded(JobFailure):
    error_type = "context_length_exceeded"


def over_context(context: int, prompt: int, max_tokens: int, what: str = "prompt", at_least: str | None = None) -> str:
    """Why a prompt of `prompt` tokens and `max_tokens` to generate do not fit a context of
    `context` tokens, in the words OpenAI and vLLM use, which clients match to tell a context
    overflow from other bad requests (litellm's ContextWindowExceededError and its
    `context_window_fallbacks`). `at_least`: the prompt's count is a lower bound, and why."""
    if at_least is not None:
        return (
            f"This model's maximum context length is {context} tokens. However, you requested {max_tokens} "
            f"output tokens and your {what} contains at least {prompt} input tokens ({at_least}), for a total "
            f"of at least {prompt + max_tokens} tokens. Please reduce the length of the {what} or the number "
            "of tokens to generate (max_tokens)."
        )
    return (
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt + max_tokens} tokens ({prompt} in the {what}, {max_tokens} in the completion). Please "
        f"reduce the length of the {what} or completion."
    )


class StorageError(JobFailure):
    status_code = 503  # when the API meets it: the store is unusable right now
    error_type = "storage_error"


class JobTimeout(JobFailure):
    error_type = "timeout"


class OutOfMemory(JobFailure):
    error_type = "out_of_memory"


class WorkerLost(JobFailure):
    error_type = "worker_lost"


class UnsupportedByWorker(JobFailure):
    """The job's record has fields, or values, the worker's version does not know (a newer API
    wrote it): the message names them."""

    error_type = "unsupported_by_worker"


class JobCancelled(JobFailure):
    """Not a failure of the job's own: it ends `cancelled`, not `failed`."""

    error_type = "cancelled"


class InternalError(JobFailure):
    error_type = "internal_error"


class NnsightCodeFailed(JobFailure):
    """An nnsight job's code raised (the message carries its traceback), or used what the served
    model does not have."""

    error_type = "nnsight_error"


class WeightsWritten(JobFailure):
    """An nnsight job wrote to the model's weights: its result is discarded, the weights read again."""

    error_type = "weights_written"


class ResultTooLarge(JobFailure):
    """An nnsight job saved more than ACTQ_NNSIGHT_MAX_RESULT_BYTES."""

    error_type = "result_too_large"


class PayloadMismatch(JobFailure):
    """An nnsight job's stored payload is not the one the API recorded (size or sha256), or not one
    it accepts (it decompresses past ACTQ_NNSIGHT_MAX_REQUEST_BYTES)."""

    error_type = "payload_mismatch"


class ConfigurationError(ActqError):
    error_type = "configuration_error"


class ToolError(ActqError):
    error_type = "tool_error"

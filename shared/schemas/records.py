"""A job as Redis keeps it (`JobRecord`, with its resolved capture points) and as clients read it:
one job (`JobView`), a listing's entry (`JobSummary`)."""

from __future__ import annotations

from datetime import datetime

from shared.interventions import EditPoint, Hook
from shared.schemas.base import Mode, Strict
from shared.schemas.job_request import JobRequest
from shared.schemas.results import ActivationsManifest, JobResult
from shared.states import JobStatus


class CapturePoint(Strict):
    """One resolved capture point: a module path in the model's list, and which side of it."""

    name: str  # tensor name in the file: the module path, or "<path>:input"
    module: str
    hook: Hook


class JobError(Strict):
    type: str
    message: str


class JobRecord(Strict):
    """What Redis keeps for a job. The task message carries only `id`."""

    id: str
    status: JobStatus
    model: str
    request: JobRequest
    owner: str | None = None  # id of the API key that made it (ACTQ_API_KEYS); others get 404
    idempotency: str | None = None  # the Redis key of its Idempotency-Key, removed with the job
    max_tokens: int  # resolved by the API (request or default), checked against the limits
    capture_points: list[CapturePoint] = []
    edit_points: list[EditPoint] = []  # the interventions at each module, resolved by the API
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    # deliveries that ended through no fault of the job (its engine was ended by another job's
    # trusted code, or replaced after it): not counted against ACTQ_MAX_ATTEMPTS
    forgiven_attempts: int = 0
    worker: str | None = None
    result: JobResult | None = None
    activations: ActivationsManifest | None = None
    error: JobError | None = None
    # The version of actq that last wrote the record (the job store stamps it on every write; None:
    # written before it did). An older version names it when it cannot read the record (rolling upgrades).
    written_by: str | None = None


class JobView(Strict):
    """`GET /jobs/{id}`. `queue_position` (1 = next) while queued, `generated_tokens` while running."""

    id: str
    status: JobStatus
    model: str
    mode: Mode = "generate"  # the request's: `generate`, `trace`, or `nnsight` (its saves in `result.nnsight`)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    # of `attempts`, those that ended through no fault of the job (another job's trusted code
    # ended the engine running it): not counted against ACTQ_MAX_ATTEMPTS
    forgiven_attempts: int = 0
    # the worker that claimed its last attempt: its Celery node name, as Flower and `celery inspect`
    # show it (None while queued)
    worker: str | None = None
    result: JobResult | None
    activations: ActivationsManifest | None
    error: JobError | None
    queue_position: int | None = None
    generated_tokens: int | None = None


class JobSummary(Strict):
    """`GET /jobs` entry: what a listing needs, never the result (read that with GET /jobs/{id})."""

    id: str
    status: JobStatus
    model: str
    mode: Mode
    created_at: datetime
    finished_at: datetime | None
    prompt_preview: str  # the first 200 characters of the prompt (a chat: of its last message)
    error_type: str | None  # a failed or cancelled job's `error.type`
    finish_reason: str | None  # a finished job's `result.finish_reason`
    activations: bool  # the job stored an activations file
    metadata: dict[str, str] | None = None  # the request's `metadata`
    user: str | None = None  # the request's `user`

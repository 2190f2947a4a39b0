"""`POST /jobs/batch`: many job requests validated together, and the ids it answers."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from shared.schemas.base import Strict
from shared.schemas.job_request import JobRequest

MAX_BATCH = 5000


class BatchEntry(Strict):
    request: JobRequest
    idempotency_key: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class BatchRequest(Strict):
    """`POST /jobs/batch`: many jobs, validated together; one bad entry rejects the batch."""

    jobs: Annotated[list[BatchEntry], Field(min_length=1, max_length=MAX_BATCH)]

    @field_validator("jobs", mode="before")
    @classmethod
    def _count_first(cls, value: object) -> object:
        # Count the entries before validating any: a 100,000-entry batch is refused in
        # microseconds instead of after 0.8 s of validation on the API's event loop.
        if isinstance(value, list) and len(value) > MAX_BATCH:
            raise ValueError(f"List should have at most {MAX_BATCH} items, not {len(value)}")
        return value


class BatchItem(Strict):
    id: str
    status: str
    created: bool  # False: an earlier request with the same Idempotency-Key created it


class BatchResponse(Strict):
    jobs: list[BatchItem]

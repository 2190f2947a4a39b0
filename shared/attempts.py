"""Attempts: which run of a job a worker holds, and the fence on its outcome.

A claim increments the record's `attempts` and names its `worker`: that pair is the attempt. A
job is claimed again when its worker looked lost (paused, or cut off from Redis, past the
heartbeat TTL: worker/lost_messages.py sends its message again), so two attempts of one job can
both run to the end. Each writes its files under a folder of its own
(shared/storage/base.py `attempt_prefix`) and records its outcome only while the record still
names it, still running (JobStore.succeed and JobStore.fail with `attempt`, a compare-and-set in
the transaction that ends the job). The other's outcome is refused (StaleAttempt): it logs it,
records nothing, and removes its folder. So a record's manifest always names the files of the
run whose result it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import JobRecord
from shared.storage.base import attempt_prefix


@dataclass(frozen=True)
class Attempt:
    """One claim of a job: the record's `attempts` and `worker` as that claim wrote them."""

    number: int
    worker: str | None

    @classmethod
    def of(cls, record: JobRecord) -> Attempt:
        return cls(record.attempts, record.worker)

    def holds(self, record: JobRecord) -> bool:
        """Whether `record` is still this attempt's (no later claim)."""
        return record.attempts == self.number and record.worker == self.worker

    def prefix(self, job_id: str) -> str:
        """The storage folder this attempt writes in (`jobs/<id>/attempt-<n>-<worker>`)."""
        return attempt_prefix(job_id, self.number, self.worker)

    def published(self, job_id: str, record: JobRecord | None) -> bool:
        """Whether `record` names a file in this attempt's folder (its activations, its nnsight
        saves): then that folder is the job's result and must stay."""
        if record is None:
            return False
        named = []
        if record.activations is not None:
            named.append(record.activations.key)
        if record.result is not None and record.result.nnsight is not None and record.result.nnsight.key is not None:
            named.append(record.result.nnsight.key)
        return any(key.startswith(self.prefix(job_id) + "/") for key in named)

    def __str__(self) -> str:
        return f"attempt {self.number} on {self.worker or 'an unnamed worker'}"


class StaleAttempt(Exception):
    """An attempt's outcome was not recorded: the job was claimed again since (`record` names the
    newer attempt), has ended otherwise, or its record is gone (None: deleted or expired).
    Nothing was changed."""

    def __init__(self, job_id: str, attempt: Attempt, record: JobRecord | None) -> None:
        if record is None:
            where = "gone (deleted or expired)"
        else:
            now = Attempt.of(record)
            where = "at " + (f"{now}, {record.status.value}" if now != attempt else record.status.value)
        super().__init__(f"job {job_id}: {attempt} lost: the record is {where}")
        self.job_id = job_id
        self.attempt = attempt
        self.record = record

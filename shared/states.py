"""A job's states. Plain Python (no pydantic), so the client can share them without more imports.

queued -> running -> succeeded | failed | cancelled        (the last three are final)
"""

from __future__ import annotations

from enum import Enum


class JobStatus(str, Enum):  # noqa: UP042 - StrEnum would change str(status), which messages use
    queued = "queued"  # recorded and sent to the model's queue
    running = "running"  # a worker took it (attempts counts deliveries)
    succeeded = "succeeded"  # result and activations are stored; final
    failed = "failed"  # error holds {type, message}; final
    cancelled = "cancelled"  # final

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
TERMINAL_NAMES = frozenset(status.value for status in TERMINAL)

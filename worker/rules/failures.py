"""The one mapping from an exception raised while a job ran to the job's failure: out of memory
(`OutOfMemory`, in words the sender can act on), a `JobFailure` as raised, anything else an
`InternalError` with the exception's type and text (logged with its traceback: a bug). Every
decoder, the engine core and the job flow call `failure_of`; none builds a failure itself.

Imports no torch (the Celery side maps failures too, and never loads torch): a torch error is
recognised through the `torch` module already imported by whoever raised it.
"""

from __future__ import annotations

import logging
import signal
import sys

from shared.errors import InternalError, JobFailure, OutOfMemory

log = logging.getLogger(__name__)

OUT_OF_MEMORY = "the model ran out of memory on this job; ask for fewer tokens or capture less"


def is_oom(exc: BaseException) -> bool:
    """Whether `exc` says the device or the host ran out of memory."""
    torch = sys.modules.get("torch")
    if isinstance(exc, MemoryError) or (torch is not None and isinstance(exc, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text


def out_of_memory() -> OutOfMemory:
    """The failure of a job that ran out of memory."""
    return OutOfMemory(OUT_OF_MEMORY)


def answer_of(exc: Exception) -> Exception:
    """What the engine core answers the jobs of a pass or step that raised `exc`: out of memory
    as the job's failure now, anything else as raised (the job flow maps it with `failure_of`,
    and tests see what was injected)."""
    return out_of_memory() if is_oom(exc) else exc


def failure_of(exc: BaseException, what: str = "a job") -> JobFailure:
    """The job's failure for `exc`: out of memory, the `JobFailure` itself, or an internal error
    (logged with its traceback, as `what` that failed)."""
    if is_oom(exc):
        return out_of_memory()
    if isinstance(exc, JobFailure):
        return exc
    log.error("%s failed unexpectedly", what, exc_info=exc)
    return InternalError(f"{type(exc).__name__}: {str(exc)[:500]}")


def exit_status(code: int | None) -> str:
    """A process's end in words: its exit status or the signal that ended it."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"

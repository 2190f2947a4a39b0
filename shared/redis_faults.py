"""Redis refusing writes while it runs, told apart from Redis being away.

Three refusals, each lasting until an operator (or the disk) clears it: MISCONF (Redis cannot
write its append-only file or snapshot, e.g. a full disk), OOM (`maxmemory` reached under
`noeviction`), READONLY (this Redis became a replica). Reads still work. The API answers 503
naming the refusal; the worker's job store and broker wait a refusal out as they wait out an
outage (ACTQ_REDIS_OUTAGE_SECONDS). Any other error reply is a bug and is not retried.
"""

from __future__ import annotations

import redis


class WritesRefused(redis.ConnectionError):
    """A write refusal raised as a connection error, for code (kombu, Celery) that rides out only
    those: the worker's broker connections raise this instead of the refusal's ResponseError."""


def refusal(exc: BaseException) -> str | None:
    """ "MISCONF Errors writing to the AOF file: ..." when `exc` is Redis refusing a write (also
    inside a pipeline, whose errors redis-py prefixes with the command); None for anything else."""
    if isinstance(exc, WritesRefused):
        return str(exc)
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        code = "OOM"
    elif isinstance(exc, redis.exceptions.ReadOnlyError):
        code = "READONLY"
    elif isinstance(exc, redis.ResponseError) and "MISCONF " in str(exc):
        code = "MISCONF"
    else:
        return None
    text = str(exc)
    text = (text.partition(" caused error: ")[2] or text).split(" script: ")[0]
    text = text[text.index("MISCONF ") :] if code == "MISCONF" else text.removeprefix(f"{code} ")
    return text if text.startswith(code) else f"{code} {text}"


def refuses_writes(exc: BaseException) -> bool:
    return refusal(exc) is not None

"""Finding a job for a caller: ids are checked before any lookup, and with API keys a caller sees
only its own jobs (another key's job is unknown: 404, not 403, so its existence is not disclosed)."""

from __future__ import annotations

import re

from api.deps import Services
from shared.errors import ActqError, JobNotFound, UnreadableRecord
from shared.schemas import JobRecord

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def load(services: Services, job_id: str, caller: str | None) -> JobRecord:
    """Job ids are uuid4s; anything else is unknown without touching Redis or the disk. With API
    keys, another key's job is unknown too (404, not 403: its existence is not disclosed). A
    record a newer version wrote that this one cannot read is UnreadableRecord (409), for its
    owner only."""
    try:
        record = services.jobs.get(job_id) if _UUID.fullmatch(job_id) else None
    except UnreadableRecord as exc:
        raise _unreadable(services, job_id, caller, exc) from None
    return _visible(services, job_id, caller, record)


async def load_async(services: Services, job_id: str, caller: str | None) -> JobRecord:
    """`load` on the event loop (redis.asyncio): the hot path of polling clients."""
    try:
        record = await services.jobs.get_async(job_id) if _UUID.fullmatch(job_id) else None
    except UnreadableRecord as exc:
        raise _unreadable(services, job_id, caller, exc) from None
    return _visible(services, job_id, caller, record)


def _unreadable(services: Services, job_id: str, caller: str | None, exc: UnreadableRecord) -> ActqError:
    """What an unreadable record's owner sees (it); with API keys, anyone else sees no job, as
    does everyone when its owner cannot be read."""
    if services.settings.api_key_list and exc.owner != caller:
        return JobNotFound(f"no job with id {job_id!r}")
    return exc


def _visible(services: Services, job_id: str, caller: str | None, record: JobRecord | None) -> JobRecord:
    if record is None or (services.settings.api_key_list and record.owner != caller):
        raise JobNotFound(f"no job with id {job_id!r}")
    return record

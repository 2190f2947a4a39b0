"""GET /jobs: its filters, the index a listing reads, and its cursor.

A listing reads one sorted set of job ids by creation time, newest first (shared/keys.py): the
smallest tag index of the filters when they name tags (one `metadata` pair, or the `user`; written
with the job), else the index of the asked state, else the owner's index. The records it reads are
checked against the filters that index does not answer (further tags, the state). One request
reads at most `limit` matches and SCAN_LIMIT index entries (records), so its cost never grows with
the owner's jobs; a request that stops before the index ends answers a cursor, from which the next
request goes on (`x-actq-next-cursor`, `?cursor=`).

The cursor is the last entry read, `<score>:<job id>`: the next read starts right after that job
in the index (ZREVRANK, one Lua call, so nothing removed meanwhile is skipped), or, when the job
has left the index since (deleted, expired), at the first entry no newer than its score.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from shared import keys
from shared.schemas import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_USER_CHARS,
    JobRecord,
    JobRequest,
    JobStatus,
    JobSummary,
)

SCAN_LIMIT = 2000  # index entries (records) one request reads at most; above GET /jobs' largest limit
METADATA = "metadata."  # a filter on one metadata pair: `metadata.<key>=<value>`
RUN_KEY = "run"  # the metadata key of a run label (/runs/<label>/v1, `actq export --label`)
USER = "user"
CURSOR_HEADER = "x-actq-next-cursor"
UNREADABLE_HEADER = "x-actq-unreadable-jobs"  # jobs not listed: their records were written by a newer version

# The `count` entries after the cursor's job in an index, newest first, with their scores.
# KEYS: index. ARGV: cursor score ('' : from the newest), cursor job id, count.
AFTER = """
local start = 0
if ARGV[1] ~= '' then
  local rank = redis.call('ZREVRANK', KEYS[1], ARGV[2])
  if rank then start = rank + 1 else start = redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[1], '+inf') end
end
return redis.call('ZREVRANGE', KEYS[1], start, start + tonumber(ARGV[3]) - 1, 'WITHSCORES')
"""


def request_tags(request: JobRequest) -> list[tuple[str, str]]:
    """The tags a job is indexed under: each `metadata` pair, and its `user`."""
    tags = [(METADATA + key, value) for key, value in (request.metadata or {}).items()]
    return tags + ([(USER, request.user)] if request.user is not None else [])


def tag_indexes(record: JobRecord) -> list[str]:
    """The tag indexes (shared/keys.py jobs_tag_index) that list this job."""
    return [keys.jobs_tag_index(record.owner, field, value) for field, value in request_tags(record.request)]


@dataclass(frozen=True)
class JobFilters:
    """What GET /jobs keeps: every filter given must hold (AND)."""

    status: JobStatus | None = None
    tags: tuple[tuple[str, str], ...] = ()  # ("metadata.<key>", value) or ("user", value)
    created_after: datetime | None = None  # aware

    def matches(self, record: JobRecord) -> bool:
        if self.status is not None and record.status is not self.status:
            return False
        if self.created_after is not None and record.created_at <= self.created_after:
            return False
        request = record.request
        for field, value in self.tags:
            held = request.user if field == USER else (request.metadata or {}).get(field.removeprefix(METADATA))
            if held != value:
                return False
        return True

    def indexes(self, owner: str | None) -> list[str]:
        """The indexes that hold every match (the listing reads the smallest)."""
        if self.tags:
            return [keys.jobs_tag_index(owner, field, value) for field, value in self.tags]
        if self.status is not None:
            return [keys.jobs_status_index(owner, self.status.value)]
        return [keys.jobs_index(owner)]


def parse_tags(params: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The tag filters among query parameters (`metadata.<key>=<value>`, `user=<value>`), checked:
    a parameter named twice, or a key or value no job can hold, is a ValueError saying so."""
    tags: dict[str, str] = {}
    for name, value in params:
        if name != USER and not name.startswith(METADATA):
            continue
        if name in tags:
            raise ValueError(f"{name} is given twice; a job holds one value for it")
        if name == USER:
            if len(value) > MAX_USER_CHARS:
                raise ValueError(f"user has {len(value)} characters; a job's user has at most {MAX_USER_CHARS}")
        else:
            key = name.removeprefix(METADATA)
            if not 1 <= len(key) <= MAX_METADATA_KEY_CHARS:
                raise ValueError(
                    f"{name[:80]!r}: a metadata filter is metadata.<key>=<value>, the key 1 to "
                    f"{MAX_METADATA_KEY_CHARS} characters"
                )
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"{name}: metadata values have at most {MAX_METADATA_VALUE_CHARS} characters")
        tags[name] = value
    if len(tags) > MAX_METADATA_PAIRS + 1:
        raise ValueError(f"{len(tags)} metadata and user filters; a job holds at most {MAX_METADATA_PAIRS} pairs")
    return tuple(tags.items())


def as_utc(moment: datetime) -> datetime:
    """A time given without a zone is UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def encode_cursor(score: str, job_id: str) -> str:
    return f"{score}:{job_id}"


def decode_cursor(cursor: str) -> tuple[str, str]:
    """(score, job id) of a cursor GET /jobs answered; ValueError for anything else."""
    score, _, job_id = cursor.partition(":")
    try:
        float(score)
        uuid.UUID(job_id)
    except ValueError:
        raise ValueError("cursor is not one GET /jobs answered (its x-actq-next-cursor header)") from None
    return score, job_id


@dataclass
class JobPage:
    """One GET /jobs answer: the summaries, the cursor to go on from (None: nothing more), and the
    ids of the jobs read on the way whose records this version cannot read (written by a newer
    one: shared/newer_records.py), which are not listed and may or may not pass the filters."""

    jobs: list[JobSummary]
    cursor: str | None
    unreadable: tuple[str, ...] = ()

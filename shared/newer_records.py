"""Records a newer version of actq wrote: what this version reads of them (rolling upgrades).

During a rolling upgrade (or after a rollback) processes of two versions share one Redis, and a
job's record may hold what this version does not know:

- fields it does not know: left out when the record is read (`read`), so the job is answered for,
  listed and waited on as usual. A worker does not run a *request* with such fields: `checked`
  names them and the claim fails the job as `unsupported_by_worker`.
- values it does not know in fields it does (a new `mode`, `status` or `finish_reason`, a float
  `attempts`): the record cannot be read as a JobRecord at all. `read` raises UnreadableRecord
  naming each such field, its value and the version that wrote the record (`written_by`, which
  the job store stamps on every write), with what could be read of it (`job`) and, when its id,
  state, model, owner and creation time could be, its `core`: enough for the job store to end
  the job (`ended_as_stored`) without rewriting what it does not understand.

What the API and the worker do with such a record: docs/reliability.md, "Rolling upgrades".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.errors import JobCancelled, JobFailure, UnreadableRecord
from shared.schemas import JobRecord, JobStatus

try:
    VERSION = version("actq")  # stamped on every record this version writes (`written_by`)
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "unknown"

SHOWN = ("id", "status", "model", "created_at", "started_at", "finished_at", "attempts", "worker", "written_by")
SHOWN_CHARS = 200  # of each string shown from an unreadable record
NAMED = 8  # unreadable fields named at most (a union's alternatives each report one)


class RecordCore(BaseModel):
    """What every change of a record needs (its indexes, its owner's quota, its event): these
    fields, read whatever else the record holds."""

    model_config = ConfigDict(extra="ignore")

    id: str
    status: JobStatus
    model: str
    owner: str | None = None
    created_at: datetime
    written_by: str | None = None


def read(raw: str | bytes) -> JobRecord:
    """A stored record; fields this version does not know are left out. UnreadableRecord when
    it holds values this version does not know (or is not a record at all)."""
    try:
        return JobRecord.model_validate_json(raw, extra="ignore")
    except ValidationError as exc:
        raise unreadable(raw, exc) from None


def checked(raw: str | bytes) -> tuple[JobRecord, list[str]]:
    """A stored record and the fields of its request that this version does not know (dotted
    paths). One strict parse; only a record that fails it is parsed again, without the unknown
    fields (UnreadableRecord when that fails too)."""
    try:
        return JobRecord.model_validate_json(raw), []
    except ValidationError as exc:
        fields = [
            ".".join(str(part) for part in error["loc"][1:])
            for error in exc.errors()
            if error["type"] == "extra_forbidden" and error["loc"][:1] == ("request",)
        ]
        return read(raw), fields


def unreadable(raw: str | bytes, exc: ValidationError) -> UnreadableRecord:
    """The UnreadableRecord for `raw`, whose parse failed with `exc`."""
    data = stored_fields(raw)
    problems = [
        {
            "field": ".".join(str(p) for p in error["loc"]) or "(the record)",
            "value": _value(error.get("input")),
            "problem": error["msg"],
        }
        for error in exc.errors()
        if error["type"] != "extra_forbidden"
    ][:NAMED]
    job = {name: _shown(data[name]) for name in SHOWN if name in data and _scalar(data[name])}
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("type"), str) and isinstance(error.get("message"), str):
        job["error"] = {"type": error["type"][:SHOWN_CHARS], "message": error["message"][:4000]}
    try:
        core = RecordCore.model_validate(data)
    except ValidationError:
        core = None
    what = "; ".join(f"{p['field']} = {p['value']} ({p['problem']})" for p in problems)
    name = f"job {job['id']}" if "id" in job else "a job"
    return UnreadableRecord(
        f"{name}: its record was written by {writer(data)}, and this version of actq ({VERSION}) cannot read "
        f"{what}; what it can read is under `job`; read it through an API of the version that wrote it",
        job,
        problems,
        data["owner"] if isinstance(data.get("owner"), str) else None,
        core,
    )


def writer(data: dict[str, Any]) -> str:
    """Who wrote a record, in words: `actq <version>`, or a newer version that did not say."""
    stamp = data.get("written_by")
    if isinstance(stamp, str) and stamp:
        return f"actq {stamp[:40]}"
    return f"a version of actq that does not record its own (newer than {VERSION}, or older than 0.1.0)"


def newer_fields_message(fields: Sequence[str]) -> str:
    """The message of the `unsupported_by_worker` failure of a job whose request has fields this
    version does not know."""
    return (
        f"the job's request has fields this worker's version of actq does not know ({', '.join(fields[:NAMED])}): it "
        "was submitted through a newer API; upgrade this model's workers and submit it again"
    )


def unsupported(exc: UnreadableRecord) -> str:
    """The message of the `unsupported_by_worker` failure of a job whose record is unreadable."""
    what = "; ".join(f"{p['field']} = {p['value']}" for p in exc.unreadable)
    return (
        f"the job's record holds values this worker's version of actq ({VERSION}) does not know ({what}): it was "
        f"written by {writer(exc.job)}; upgrade this model's workers and submit it again"
    )


def ended_as_stored(raw: str | bytes, failure: JobFailure, now: datetime) -> str:
    """An unreadable record ended with `failure` (`failed`, or `cancelled` for a JobCancelled):
    its state, error and end time changed, everything else kept as stored, unknown values too
    (so the version that wrote them still reads them)."""
    data = stored_fields(raw)
    status = JobStatus.cancelled if isinstance(failure, JobCancelled) else JobStatus.failed
    data.update(status=status.value, error=failure.as_error(), finished_at=now.isoformat())
    return json.dumps(data)


def stored_fields(raw: str | bytes) -> dict[str, Any]:
    """A stored record's JSON object as written, whatever version wrote it ({} if it is none)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _shown(value: object) -> object:
    return value[:SHOWN_CHARS] if isinstance(value, str) else value


def _value(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."

"""How a stored job is shown to clients: the public JobView, with its download URL and live fields."""

from __future__ import annotations

from fastapi import Request

from shared.schemas import JobRecord, JobView


def view(record: JobRecord, request: Request, live: dict[str, int | None] | None = None) -> JobView:
    """The public shape of a record; `live` adds queue_position / generated_tokens."""
    data = record.model_dump(include=set(JobView.model_fields))
    data["mode"] = record.request.mode
    data.update(live or {})
    if record.activations is not None:
        data["activations"]["download_url"] = str(request.url_for("download_activations", job_id=record.id))
    if record.result is not None and record.result.stored is not None:
        data["result"]["stored"]["url"] = str(request.url_for("get_job_result", job_id=record.id))
    return JobView.model_validate(data)

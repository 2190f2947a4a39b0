"""A job record's changes and views that need no Redis round trip: ended (failed or cancelled),
summarized for GET /jobs, its result split between the record and a key of its own, its live
fields (queue position, generated tokens), its figures counted into the stats at its end."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shared import keys, stats
from shared.errors import JobCancelled, JobFailure
from shared.schemas import RESULT_PREVIEW_CHARS, RESULT_TEXT_INLINE_CHARS, JobRecord, JobResult, JobStatus, JobSummary

RESULT_INLINE_BYTES = 16 << 10  # a result's JSON above this is stored apart (ACTQ_RESULT_INLINE_BYTES)
PREVIEW_CHARS = 200  # of a job's prompt, in GET /jobs


def now() -> datetime:
    return datetime.now(UTC)


def record_stats(pipe: Any, record: JobRecord) -> None:
    """A job just ended: its figures go into the model's counters and histograms (same MULTI)."""
    counters = keys.counters(record.model)
    pipe.hincrby(counters, record.status.value, 1)
    if record.result is not None:
        pipe.hincrby(counters, "generated_tokens", record.result.usage.completion_tokens)
    if record.activations is not None:
        pipe.hincrby(counters, "captured_bytes", record.activations.bytes)
    if record.started_at is not None:
        stats.observe(pipe, record.model, "queue_wait", (record.started_at - record.created_at).total_seconds())
        if record.finished_at is not None:
            stats.observe(pipe, record.model, "duration", (record.finished_at - record.started_at).total_seconds())


def split_result(result: dict[str, Any], inline_bytes: int) -> tuple[JobResult, bytes | None]:
    """A result for the record (validated), and the whole result's JSON when it is larger than
    `inline_bytes` (None: it stays whole in the record). The record's copy of a larger one keeps
    the totals, the text unless it is longer than RESULT_TEXT_INLINE_CHARS (then its first
    RESULT_PREVIEW_CHARS), and says where the rest is (`stored`)."""
    validated = JobResult.model_validate(result)
    whole = validated.model_dump_json().encode()
    if len(whole) <= inline_bytes:
        return validated, None
    text = result["text"]
    cut = len(text) > RESULT_TEXT_INLINE_CHARS
    summary = {**result, "text": text[:RESULT_PREVIEW_CHARS] if cut else text}
    if result.get("logprobs") is not None:
        summary["logprobs"] = {**result["logprobs"], "content": None}
    summary["stored"] = {"bytes": len(whole), "text_truncated": cut}
    return JobResult.model_validate(summary), whole


def summarize(record: JobRecord) -> JobSummary:
    """A job as GET /jobs lists it."""
    request = record.request
    if request.nnsight is not None:
        prompt = f"[nnsight payload {request.nnsight.sha256[:12]}] {request.nnsight.model_key}"
    elif request.prompt_token_ids is not None:
        prompt = f"[{len(request.prompt_token_ids)} token ids] " + " ".join(map(str, request.prompt_token_ids[:40]))
    else:
        prompt = request.prompt if request.prompt is not None else (request.messages or [])[-1].text
    return JobSummary(
        id=record.id,
        status=record.status,
        model=record.model,
        mode=request.mode,
        created_at=record.created_at,
        finished_at=record.finished_at,
        prompt_preview=prompt[:PREVIEW_CHARS],
        error_type=record.error.type if record.error is not None else None,
        finish_reason=record.result.finish_reason if record.result is not None else None,
        activations=record.activations is not None,
        metadata=request.metadata,
        user=request.user,
    )


def live_fields_of(record: JobRecord, rank: int | None, tokens: bytes | str | None) -> dict[str, int | None]:
    if record.status is JobStatus.queued:
        return {"queue_position": None if rank is None else rank + 1}
    if record.status is JobStatus.running:
        return {"generated_tokens": int(tokens) if tokens is not None else 0}
    return {}


def same_outcome(stored: JobRecord, wanted: JobRecord) -> bool:
    """Whether `stored` is `wanted` but for the time it was written."""
    return stored.model_dump(exclude={"finished_at"}) == wanted.model_dump(exclude={"finished_at"})


def ended(record: JobRecord, failure: JobFailure, result: JobResult | None) -> JobRecord:
    status = JobStatus.cancelled if isinstance(failure, JobCancelled) else JobStatus.failed
    data = record.model_dump()
    data.update(status=status, error=failure.as_error(), finished_at=now())
    if result is not None:
        data["result"] = result
    return JobRecord.model_validate(data)

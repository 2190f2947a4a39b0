"""Large results live apart from the job's record (issue 22): the record stays small, the whole
result is one Redis key with the record's TTL, written in the same transaction and deleted with
the job; GET /jobs lists summaries."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.errors import JobCancelled
from shared.jobs import JobStore
from shared.schemas import JobRecord, JobStatus
from tests.shared.test_jobs import celery, new_job, record  # noqa: F401 - the fixture

ENTRY = {
    "token_id": 7,
    "token": " word",
    "logprob": -1.5,
    "top_logprobs": [{"token_id": i, "token": f" t{i}", "logprob": -float(i)} for i in range(20)],
}


def big_result(tokens: int = 400, text: str = "") -> dict:
    return {
        "text": text,
        "finish_reason": "length",
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "logprobs": {"content": [ENTRY] * tokens, "total": -600.0, "completion_total": None},
    }


@pytest.fixture
def store(redis_client):
    return JobStore(redis_client, retention_seconds=60)


def test_a_large_result_is_stored_apart_and_the_record_stays_small(store, celery, redis_client):  # noqa: F811
    job_id = new_job(store, celery)
    store.claim(job_id, "w", 3)
    result = big_result(text="y" * 5000)
    store.succeed(job_id, result, None, inline_bytes=16 << 10)

    raw = redis_client.get(keys.job(job_id))
    assert len(raw) < 4000  # the 400 entries (~0.5 MB) are not in it
    shown = JobRecord.model_validate_json(raw).result
    assert shown is not None and shown.stored is not None
    assert shown.logprobs is not None and shown.logprobs.content is None and shown.logprobs.total == -600.0
    assert shown.text == "y" * 200 and shown.stored.text_truncated and shown.usage.prompt_tokens == 400
    whole = redis_client.get(keys.result(job_id))
    assert shown.stored.bytes == len(whole) and json.loads(whole)["text"] == "y" * 5000
    assert json.loads(whole)["logprobs"]["content"] == [{**ENTRY, "rank": None}] * 400  # as validated
    ttl, result_ttl = redis_client.pttl(keys.job(job_id)), redis_client.pttl(keys.result(job_id))
    assert 0 < result_ttl <= ttl + 50  # the record's TTL, not a fresh one

    store.delete(store.get(job_id))
    assert redis_client.exists(keys.result(job_id)) == 0


def test_a_small_result_stays_in_the_record(store, celery, redis_client):  # noqa: F811
    job_id = new_job(store, celery)
    store.claim(job_id, "w", 3)
    store.succeed(job_id, big_result(tokens=2), None, inline_bytes=16 << 10)
    shown = store.get(job_id).result
    assert shown.stored is None and len(shown.logprobs.content) == 2
    assert redis_client.exists(keys.result(job_id)) == 0


def test_a_late_partial_result_does_not_replace_a_finished_jobs_stored_result(store, celery, redis_client):  # noqa: F811
    """The stored result is written in the record's transaction: a change that is declined (the
    job is terminal already) writes nothing."""
    job_id = new_job(store, celery)
    store.claim(job_id, "w", 3)
    store.succeed(job_id, big_result(text="first"), None)
    before = redis_client.get(keys.result(job_id))
    assert store.fail(job_id, JobCancelled("late"), big_result(text="late partial")) is None
    assert redis_client.get(keys.result(job_id)) == before and store.get(job_id).status is JobStatus.succeeded


def test_a_cancelled_jobs_large_partial_result_is_stored_apart_too(store, celery, redis_client):  # noqa: F811
    job_id = new_job(store, celery)
    store.claim(job_id, "w", 3)
    store.fail(job_id, JobCancelled("stopped"), big_result(text="partial"))
    shown = store.get(job_id).result
    assert shown.stored is not None and shown.text == "partial" and not shown.stored.text_truncated
    assert json.loads(redis_client.get(keys.result(job_id)))["logprobs"]["content"] == [{**ENTRY, "rank": None}] * 400


def test_the_stored_result_streams_in_chunks_as_stored(store, celery, redis_client, redis_server):  # noqa: F811
    job_id = new_job(store, celery)
    store.claim(job_id, "w", 3)
    store.succeed(job_id, big_result(), None)
    whole = redis_client.get(keys.result(job_id))

    async def read() -> list[bytes]:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            reader = JobStore(redis_client, 60, aclient=client)
            return [c async for c in reader.stream_stored_result(job_id, len(whole), chunk=64 << 10)]
        finally:
            await client.aclose()

    chunks = asyncio.run(read())
    assert b"".join(chunks) == whole and max(len(c) for c in chunks) == 64 << 10 and len(chunks) > 1


def test_listing_gives_summaries_without_results(store, celery, redis_client):  # noqa: F811
    job = record()
    job = job.model_copy(update={"request": job.request.model_copy(update={"messages": None, "prompt": "p" * 500})})
    store.enqueue([job], celery)
    store.claim(job.id, "w", 3)
    store.succeed(job.id, big_result(), None)
    (summary,) = store.list(None, None, 10)
    data = summary.model_dump()
    assert data["id"] == job.id and data["status"] == "succeeded" and data["prompt_preview"] == "p" * 200
    assert data["finish_reason"] == "length" and data["error_type"] is None and "result" not in data


def test_a_text_up_to_4096_characters_stays_whole_in_the_record(store, celery):  # noqa: F811
    """Only the entries go apart: tools that read `text` from GET /jobs/{id} (actq run-file) keep
    reading it whole unless it is very long."""
    job_id = new_job(store, celery)
    store.claim(job_id, "w", 3)
    store.succeed(job_id, big_result(text="z" * 4096), None)
    shown = store.get(job_id).result
    assert shown.stored is not None and not shown.stored.text_truncated and shown.text == "z" * 4096


def test_a_large_record_is_parsed_off_the_event_loop(store, celery, redis_client, redis_server):  # noqa: F811
    """GET /jobs/{id} parses the record on the event loop; past 64 KiB (a long prompt) that goes
    to a thread, so one large record does not hold up every other request."""
    small = new_job(store, celery)
    job = record()
    job = job.model_copy(update={"request": job.request.model_copy(update={"messages": None, "prompt": "p" * 100_000})})
    store.enqueue([job], celery)
    threads: list[str] = []
    original = JobRecord.model_validate_json

    def parse(raw, **options):
        threads.append(threading.current_thread().name)
        return original(raw, **options)

    async def read() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            reader = JobStore(redis_client, 60, aclient=client)
            assert (await reader.get_async(small)).id == small
            assert (await reader.get_async(job.id)).request.prompt == "p" * 100_000
        finally:
            await client.aclose()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JobRecord, "model_validate_json", parse)
        asyncio.run(read())
    loop = threading.main_thread().name
    assert threads[0] == loop and threads[1] != loop, threads

"""Hostile requests get a clear 4xx with nothing enqueued."""

from __future__ import annotations

import pytest

from tests.support.stack import TINY, job_count, queued_messages


def _nested(depth: int) -> bytes:
    return b'{"model": "tiny", "messages": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = [
    ("10 MB message", {"model": TINY, "messages": [{"role": "user", "content": "x" * (10 << 20)}]}, None, (413, 422)),
    ("deeply nested JSON", None, _nested(100_000), (400, 413, 422)),
    (
        "huge max_tokens",
        {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**18},
        None,
        (422,),
    ),
    (
        "huge temperature",
        {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "temperature": 1e308},
        None,
        (422,),
    ),
    ("negative top_p", {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "top_p": -0.5}, None, (422,)),
    (
        "thousands of capture paths",
        {
            "model": TINY,
            "messages": [{"role": "user", "content": "hi"}],
            "capture": {"modules": [f"model.layers.{i % 4}" for i in range(5000)]},
        },
        None,
        (422,),
    ),
    (
        "dunder capture path",
        {
            "model": TINY,
            "messages": [{"role": "user", "content": "hi"}],
            "capture": {"modules": ["__class__.__init__.__globals__"]},
        },
        None,
        (422,),
    ),
    (
        "a batch of 100,000 jobs",
        {"jobs": [{"request": {"model": TINY, "messages": [{"role": "user", "content": "hi"}]}}] * 100_000},
        None,
        (413, 422),
    ),
]


@pytest.mark.parametrize(("case", "payload", "raw", "statuses"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_a_clear_4xx_and_nothing_is_queued(http, redis_client, case, payload, raw, statuses):
    before = job_count(redis_client), queued_messages(redis_client, TINY)
    path = "/jobs/batch" if payload and "jobs" in payload else "/jobs"
    if raw is not None:
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=payload)
    assert response.status_code in statuses, (case, response.status_code, response.text[:300])
    body = response.json()
    assert body["error"] and body["detail"] and "Traceback" not in response.text
    assert (job_count(redis_client), queued_messages(redis_client, TINY)) == before

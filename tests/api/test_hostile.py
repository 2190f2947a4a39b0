"""Hostile requests get a clear 4xx with nothing enqueued."""

from __future__ import annotations

import pytest

from tests.support.hostile import HOSTILE
from tests.support.stack import TINY, job_count, queued_messages


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

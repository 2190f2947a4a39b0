"""Redis refusing writes (OOM under `maxmemory` + noeviction; READONLY after REPLICAOF) on the
real app: submissions answer 503 naming the refusal, nothing is queued, and the API works again
by itself once Redis accepts writes."""

from __future__ import annotations

import pytest

from shared.cli.processes import free_port
from tests.support.stack import TINY, job_count, queued_messages

JOB = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def refuse_oom(client) -> None:
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)


def allow_oom(client) -> None:
    client.config_set("maxmemory", 0)


def refuse_readonly(client) -> None:
    client.replicaof("127.0.0.1", free_port())  # a master that is not there: a read-only replica


def allow_readonly(client) -> None:
    client.replicaof("NO", "ONE")


@pytest.mark.parametrize(
    ("refuse", "allow", "reason"),
    [
        (refuse_oom, allow_oom, "refuses writes: OOM command not allowed when used memory > 'maxmemory'"),
        (refuse_readonly, allow_readonly, "refuses writes: READONLY You can't write against a read only replica"),
    ],
    ids=["oom", "readonly"],
)
def test_write_refusals_answer_503_naming_the_reason(http, redis_client, refuse, allow, reason):
    before = http.post("/jobs", json=JOB).json()["id"]
    refuse(redis_client)
    try:
        for response in (
            http.post("/jobs", json=JOB),
            http.post("/jobs", json=JOB, headers={"Idempotency-Key": "refused"}),
            http.post("/jobs/batch", json={"jobs": [{"request": JOB}] * 3}),
        ):
            assert response.status_code == 503, response.text
            assert response.json()["error"] == "service_unavailable"
            assert reason in response.json()["detail"], response.text
        chat = http.post("/v1/chat/completions", json=JOB)  # OpenAI's error shape, the same reason
        assert chat.status_code == 503 and reason in chat.json()["error"]["message"], chat.text
        assert http.get(f"/jobs/{before}").json()["status"] == "queued"  # reads still work
    finally:
        allow(redis_client)
    assert job_count(redis_client) == 1 and queued_messages(redis_client, TINY) == 1
    assert http.post("/jobs", json=JOB, headers={"Idempotency-Key": "refused"}).status_code == 202

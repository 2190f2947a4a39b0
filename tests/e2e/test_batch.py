"""POST /jobs/batch: all entries validated first, one bad entry rejects the batch, keys make retries safe."""

from __future__ import annotations

from tests.support.stack import TINY, job_count, queued_messages


def entry(i: int, key: str | None = None, **changes) -> dict:
    request = {
        "model": TINY,
        "messages": [{"role": "user", "content": f"Problem {i}: what is {i} + 1?"}],
        "max_tokens": 3,
        "capture": {"modules": ["model.layers.{1,2}.input_layernorm"], "positions": "generated"},
    }
    request.update(changes)
    return {"request": request, "idempotency_key": key}


def test_a_batch_runs_every_job(live, http):
    response = http.post("/jobs/batch", json={"jobs": [entry(i) for i in range(12)]})
    assert response.status_code == 202
    items = response.json()["jobs"]
    assert len(items) == 12 and len({i["id"] for i in items}) == 12
    assert all(i["status"] == "queued" and i["created"] for i in items)
    jobs = [live.wait(http, i["id"]) for i in items]
    assert all(j["status"] == "succeeded" for j in jobs)
    assert [j["activations"]["tensors"][0]["shape"] for j in jobs] == [[3, 64]] * 12


def test_one_bad_entry_rejects_the_batch_and_nothing_is_queued(http, redis_client):
    before = job_count(redis_client), queued_messages(redis_client, TINY)
    cases = [
        (
            entry(5, capture={"modules": ["model.layers.9"]}),
            422,
            "jobs[7]: capture path 'model.layers.9' names no module",
        ),
        (entry(5, model="nope"), 404, "jobs[7]: model 'nope' is not served here"),
        (entry(5, max_tokens=100_000), 422, "jobs[7]: max_tokens 100000 exceeds the limit"),
        (
            {"request": {"model": TINY, "messages": []}},
            422,
            "jobs.7.request.messages: List should have at least 1 item",
        ),
    ]
    for bad, status, message in cases:
        jobs = [entry(i) for i in range(10)]
        jobs[7] = bad
        response = http.post("/jobs/batch", json={"jobs": jobs})
        assert response.status_code == status and message in response.json()["detail"], response.text
    assert (job_count(redis_client), queued_messages(redis_client, TINY)) == before
    empty = http.post("/jobs/batch", json={"jobs": []})
    assert empty.status_code == 422 and "jobs: List should have at least 1 item" in empty.json()["detail"]
    huge = http.post("/jobs/batch", json={"jobs": [entry(0)] * 5001})
    assert huge.status_code == 422 and "at most 5000 items" in huge.json()["detail"]


def test_idempotency_keys_make_a_repeated_batch_safe(live, http, redis_client):
    jobs = [entry(i, key=f"run-a:{i}") for i in range(6)]
    first = http.post("/jobs/batch", json={"jobs": jobs[:4]}).json()["jobs"]
    before = job_count(redis_client)
    again = http.post("/jobs/batch", json={"jobs": jobs}).json()["jobs"]  # a resumed run: 4 old, 2 new
    assert [i["id"] for i in again[:4]] == [i["id"] for i in first]
    assert [i["created"] for i in again] == [False] * 4 + [True] * 2
    assert job_count(redis_client) == before + 2
    for item in again:
        assert live.wait(http, item["id"])["status"] == "succeeded"
    changed = [entry(i, key=f"run-a:{i}") for i in range(6)]
    changed[3] = entry(99, key="run-a:3")
    conflict = http.post("/jobs/batch", json={"jobs": changed})
    assert (
        conflict.status_code == 409
        and "jobs[3]: idempotency_key 'run-a:3' was used for a different request" in conflict.json()["detail"]
    )
    twice = http.post("/jobs/batch", json={"jobs": [entry(1, key="k"), entry(2, key="k")]})
    assert twice.status_code == 422 and "share an idempotency_key" in twice.json()["detail"]
    assert job_count(redis_client) == before + 2

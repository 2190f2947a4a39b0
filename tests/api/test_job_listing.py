"""GET /jobs over HTTP on a real Redis: each job's metadata, user and prompt preview; the metadata,
user, state and time filters (ANDed); the cursor through every page; the cost bound; and the
request's `metadata` and `user` checked with messages that say what to fix."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from shared import keys
from shared.errors import JobCancelled
from shared.jobs import JobStore
from shared.schemas import JobRecord
from tests.support.stack import TINY

CURSOR = "x-actq-next-cursor"


def job(http, prompt: str = "2 + 2 =", **fields) -> str:
    response = http.post("/jobs", json={"model": TINY, "prompt": prompt, "max_tokens": 2, **fields})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def listed(http, **params) -> list[str]:
    response = http.get("/jobs", params=params)
    assert response.status_code == 200, response.text
    return [j["id"] for j in response.json()]


def test_summaries_show_metadata_user_and_each_kind_of_prompt(http):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour. " * 30}]
    raw = job(http, "The capital of France is", metadata={"run": "a", "sample": "7"}, user="alice")
    talk = http.post("/jobs", json={"model": TINY, "messages": chat, "max_tokens": 2, "user": "bob"}).json()["id"]
    ids = http.post("/jobs", json={"model": TINY, "prompt_token_ids": [1, 2, 3], "max_tokens": 2}).json()["id"]
    by_id = {j["id"]: j for j in http.get("/jobs").json()}
    assert by_id[raw]["metadata"] == {"run": "a", "sample": "7"} and by_id[raw]["user"] == "alice"
    assert by_id[raw]["prompt_preview"] == "The capital of France is"
    assert by_id[talk]["prompt_preview"] == ("Name a colour. " * 30)[:200] and by_id[talk]["metadata"] is None
    assert by_id[talk]["user"] == "bob"
    assert "1 2 3" in by_id[ids]["prompt_preview"] and by_id[ids]["user"] is None
    # the whole request as stored, for what a preview cuts
    request = http.get(f"/jobs/{talk}/request").json()
    assert request["messages"] == chat and request["user"] == "bob"


def test_filters_and_together(http):
    a1 = job(http, metadata={"run": "a", "split": "test"}, user="alice")
    a2 = job(http, metadata={"run": "a", "split": "train"}, user="bob")
    b1 = job(http, metadata={"run": "b", "split": "test"}, user="alice")
    plain = job(http)
    assert listed(http, **{"metadata.run": "a"}) == [a2, a1]
    assert listed(http, **{"metadata.split": "test"}) == [b1, a1]
    assert listed(http, **{"metadata.run": "a", "metadata.split": "test"}) == [a1]
    assert listed(http, **{"metadata.run": "b", "user": "bob"}) == []
    assert listed(http, user="alice") == [b1, a1]
    assert listed(http, **{"metadata.run": "a", "status": "queued"}) == [a2, a1]
    assert listed(http, **{"metadata.run": "a", "status": "succeeded"}) == []
    assert listed(http, **{"metadata.run": "nope"}) == []
    assert listed(http, **{"metadata.absent": "a"}) == []
    assert listed(http) == [plain, b1, a2, a1]
    # a value is matched whole: no prefix, no case folding
    assert listed(http, **{"metadata.run": "A"}) == [] and listed(http, **{"metadata.ru": "a"}) == []


def test_batch_jobs_carry_metadata_and_list_in_submission_order(http):
    request = {"model": TINY, "max_tokens": 2, "metadata": {"run": "batch"}}
    entries = [{"request": {**request, "prompt": f"p{i}"}} for i in range(6)]
    answer = http.post("/jobs/batch", json={"jobs": entries})
    assert answer.status_code == 202, answer.text
    made = [j["id"] for j in answer.json()["jobs"]]
    assert listed(http, **{"metadata.run": "batch"}) == made[::-1]  # newest first: the batch's own order
    assert listed(http) == made[::-1]


def test_the_cursor_walks_every_page_once(http):
    made = [job(http, f"p{i}", metadata={"run": "paged"}) for i in range(7)]
    for params in ({"metadata.run": "paged"}, {}):
        seen, cursor, pages = [], None, 0
        while True:
            response = http.get("/jobs", params={**params, "limit": 3, **({"cursor": cursor} if cursor else {})})
            seen += [j["id"] for j in response.json()]
            pages += 1
            cursor = response.headers.get(CURSOR)
            if cursor is None:
                break
        assert seen == made[::-1] and pages == 3, params


def test_a_cursor_whose_job_is_gone_still_goes_on_after_it(http, redis_client):
    made = [job(http, f"p{i}", metadata={"run": "paged"}) for i in range(7)]
    first = http.get("/jobs", params={"metadata.run": "paged", "limit": 3})
    assert [j["id"] for j in first.json()] == made[:3:-1]
    JobStore(redis_client, 60).cancel_queued(made[4], JobCancelled("ended by the test"))
    assert http.delete(f"/jobs/{made[4]}").status_code == 204  # the job the cursor names leaves every index
    cursor = first.headers[CURSOR]
    rest = http.get("/jobs", params={"metadata.run": "paged", "limit": 10, "cursor": cursor}).json()
    assert [j["id"] for j in rest] == made[3::-1]


def test_created_after(http):
    early = job(http, metadata={"run": "t"})
    middle = datetime.now(UTC)
    late = job(http, metadata={"run": "t"})
    assert listed(http, created_after=middle.isoformat()) == [late]
    assert listed(http, created_after=middle.replace(tzinfo=None).isoformat()) == [late]  # no zone: UTC
    assert listed(http, **{"metadata.run": "t", "created_after": "2000-01-01T00:00:00Z"}) == [late, early]


def test_a_listing_reads_a_bounded_number_of_records(http, monkeypatch):
    """Two filters: the smaller tag index is read, the other filter checked on each record; a
    request reads at most SCAN_LIMIT records and hands back a cursor to go on from."""
    monkeypatch.setattr("shared.jobs.SCAN_LIMIT", 4)
    rare = job(http, metadata={"run": "big", "pick": "yes"})
    crowd = [job(http, metadata={"run": "big"}) for _ in range(10)]
    parsed = []
    original = JobRecord.model_validate_json
    monkeypatch.setattr(JobRecord, "model_validate_json", lambda raw, **kw: parsed.append(raw) or original(raw, **kw))
    assert listed(http, **{"metadata.run": "big", "metadata.pick": "yes"}) == [rare]
    assert len(parsed) == 1  # read from the one-job index of pick=yes, not the eleven of run=big
    parsed.clear()
    first = http.get("/jobs", params={"metadata.run": "big", "status": "failed"})
    assert first.json() == [] and len(parsed) == 4 and first.headers.get(CURSOR)
    cursor, pages = first.headers[CURSOR], 1
    while cursor:
        page = http.get("/jobs", params={"metadata.run": "big", "status": "failed", "cursor": cursor})
        assert page.json() == []
        cursor, pages = page.headers.get(CURSOR), pages + 1
    assert pages == 3 and len(parsed) == 11 and crowd


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"metdata.run": "a"}, "unknown query parameter 'metdata.run': GET /jobs takes status, limit, user"),
        ({"metadata.": "a"}, "a metadata filter is metadata.<key>=<value>, the key 1 to 64 characters"),
        ({"metadata." + "k" * 65: "a"}, "the key 1 to 64 characters"),
        ({"metadata.run": "v" * 513}, "metadata.run: metadata values have at most 512 characters"),
        ({"user": "u" * 257}, "user"),
        ({"cursor": "nonsense"}, "cursor is not one GET /jobs answered"),
        ({"created_after": "yesterday"}, "created_after"),
    ],
)
def test_bad_filters_are_422_saying_what_to_fix(http, params, message):
    response = http.get("/jobs", params=params)
    assert response.status_code == 422 and message in response.json()["detail"], response.text


def test_a_filter_given_twice_is_refused(http):
    response = http.get("/jobs?metadata.run=a&metadata.run=b")
    assert response.status_code == 422 and "metadata.run is given twice" in response.json()["detail"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata: Value error, holds 17 pairs; at most 16"),
        ({"metadata": {"k" * 65: "v"}}, "has 65 characters; keys have 1 to 64"),
        ({"metadata": {"": "v"}}, "has 0 characters; keys have 1 to 64"),
        ({"metadata": {"run": "v" * 513}}, "the value of 'run' has 513 characters; values have at most 512"),
        ({"metadata": {"run": 5}}, "metadata.run: Input should be a valid string"),
        ({"metadata": ["run"]}, "metadata: Input should be an object"),
        ({"user": "u" * 257}, "user: String should have at most 256 characters"),
    ],
)
def test_bad_metadata_or_user_is_refused_with_its_reason(http, fields, message):
    response = http.post("/jobs", json={"model": TINY, "prompt": "hi", "max_tokens": 2, **fields})
    assert response.status_code == 422 and message in response.json()["detail"], response.text
    batch = http.post("/jobs/batch", json={"jobs": [{"request": {"model": TINY, "prompt": "hi", **fields}}]})
    assert batch.status_code == 422 and message.split(": ", 1)[-1] in batch.json()["detail"]
    assert http.get("/jobs").json() == []


def test_deleting_a_finished_job_leaves_its_tag_indexes(http, redis_client):
    job_id = job(http, metadata={"run": "gone"}, user="carol")
    tags = [keys.jobs_tag_index(None, "metadata.run", "gone"), keys.jobs_tag_index(None, "user", "carol")]
    assert [redis_client.zcard(t) for t in tags] == [1, 1]
    assert all(0 < redis_client.ttl(t) <= 7 * 24 * 3600 for t in tags)  # they expire with their jobs
    JobStore(redis_client, 60).cancel_queued(job_id, JobCancelled("ended by the test"))
    assert http.delete(f"/jobs/{job_id}").status_code == 204
    assert [redis_client.zcard(t) for t in tags] == [0, 0]
    assert listed(http, **{"metadata.run": "gone"}) == []

"""schemathesis hooks for tests/e2e/test_fuzz.py (loaded through SCHEMATHESIS_HOOKS): a check that
a refused request (4xx) left nothing behind. Before each call the hook counts what a submission
or an upload writes (the jobs index, the model's broker queue, the vector sets index: O(1) reads
of the Redis at ACTQ_FUZZ_REDIS_URL); after a 4xx the counts must be the same. The run is
sequential (one schemathesis worker), so nothing else writes between the two counts."""

from __future__ import annotations

import os

import redis
import schemathesis

from shared import keys

_redis = redis.Redis.from_url(os.environ["ACTQ_FUZZ_REDIS_URL"])
_MODEL = os.environ.get("ACTQ_FUZZ_MODEL", "tiny")
_before: dict[int, tuple[int, int, int]] = {}


def _counts() -> tuple[int, int, int]:
    pipe = _redis.pipeline()
    pipe.zcard(keys.jobs_index(None))
    for lane in keys.lanes(_MODEL):
        pipe.llen(lane)
    pipe.zcard(keys.vector_sets_index(None))
    jobs, *queued, vectors = pipe.execute()
    return int(jobs), sum(int(q) for q in queued), int(vectors)


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    _before[id(case)] = _counts()


@schemathesis.check
def nothing_queued_on_4xx(ctx, response, case):
    before = _before.pop(id(case), None)
    if before is None or not 400 <= response.status_code < 500:
        return None
    after = _counts()
    if after != before:
        raise AssertionError(
            f"{case.method} {case.path} answered {response.status_code} but left something behind: "
            f"(jobs, queued messages, vector sets) went from {before} to {after}"
        )
    return None

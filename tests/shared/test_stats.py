"""Histograms in Redis (shared/stats.py): each value counted once, in its own bucket, and read back
as Prometheus' cumulative buckets."""

from __future__ import annotations

import math
import random

from shared import keys, stats


def test_histograms_read_back_as_cumulative_buckets_of_every_value(redis_client):
    rng = random.Random(0)
    values = [rng.choice([0.0, 0.1, 0.1000001, 2.5, 7.0, 1800.0, 5000.0]) * rng.random() for _ in range(300)]
    values += [0.1, 2.5, 1800.0, 1e9]  # on a bound (it belongs to that bucket) and past the last finite one
    with redis_client.pipeline() as pipe:
        for start in range(0, len(values), 50):  # in parts, as jobs and heartbeats add them
            stats.observe_many(pipe, "m", "duration", values[start : start + 50])
        pipe.execute()
    figures = stats.read(redis_client, "m")["histograms"]["duration"]
    expected = [
        ("+Inf" if math.isinf(bound) else f"{bound:g}", float(sum(v <= bound for v in values)))
        for bound in stats.BUCKETS
    ]
    assert figures["buckets"] == expected
    assert figures["count"] == len(values) and math.isclose(figures["sum"], sum(values))
    assert stats.read(redis_client, "other")["histograms"]["duration"]["buckets"][-1] == ("+Inf", 0.0)


def test_one_value_writes_one_bucket_beside_sum_and_count(redis_client):
    """A job's end observes two histograms in its success transaction: 3 fields each, not one
    per bucket at or above the value (14 for a job that ran under 0.1 s)."""
    with redis_client.pipeline() as pipe:
        stats.observe(pipe, "m", "queue_wait", 0.05)
        pipe.execute()
    assert redis_client.hgetall(keys.histogram("m", "queue_wait")) == {b"0.1": b"1", b"sum": b"0.05", b"count": b"1"}

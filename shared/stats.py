"""Job figures kept in Redis so that the API's /metrics can report what the workers saw.

Per model, one hash of counters (`succeeded`, `failed`, `cancelled`, `submitted`,
`generated_tokens`, `captured_bytes`, and the engine's `decode_steps`) and one hash per
histogram (`duration`: running time, `queue_wait`: created -> started, `batch_size`: jobs in
each decoding step, `batch_occupancy`: that over the worker's ACTQ_MAX_BATCH, `nnsight_hold_own` and
`nnsight_hold_shared`: how long each nnsight job held its engine's model), whose fields count each
value once, in the lowest bucket that holds it, beside `sum` and `count`; `read` adds them up into
Prometheus' cumulative buckets. (Stored cumulative, as before, a job's end wrote 14 increments per
histogram: 32 of the 46 commands of its success transaction.) A worker's engine
adds its step figures once per heartbeat (not at every step), and keeps its tokens per second
over the last heartbeat interval in the model's `throughput` hash, and its KV cache's size then
(bytes, slots, positions per slot) in the model's `kv-cache` hash, one field per worker.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from typing import cast

import redis

from shared import keys

BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, math.inf)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, math.inf)
OCCUPANCY_BUCKETS = (0.125, 0.25, 0.5, 0.75, 1.0, math.inf)
COUNTERS = ("submitted", "succeeded", "failed", "cancelled", "generated_tokens", "captured_bytes", "decode_steps")
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, math.inf)
HISTOGRAMS = {
    "duration": BUCKETS,
    "queue_wait": BUCKETS,
    "batch_size": SIZE_BUCKETS,
    "batch_occupancy": OCCUPANCY_BUCKETS,
    # how long each nnsight job had its engine's model to itself, by where it ran
    # (ACTQ_NNSIGHT_ENGINE): on the shared engine, every other job of that worker waited as long
    "nnsight_hold_own": HOLD_BUCKETS,
    "nnsight_hold_shared": HOLD_BUCKETS,
}


def _bucket(value: float) -> str:
    return "+Inf" if math.isinf(value) else f"{value:g}"


def observe(pipe: redis.client.Pipeline, model: str, histogram: str, seconds: float) -> None:
    observe_many(pipe, model, histogram, [seconds])


def observe_many(pipe: redis.client.Pipeline, model: str, histogram: str, values: list[float]) -> None:
    """Add `values` to a histogram: one increment per bucket they fall in (each value in the
    lowest bucket that holds it), however many values."""
    if not values:
        return
    name = keys.histogram(model, histogram)
    bounds = HISTOGRAMS[histogram]
    hits = Counter(bounds[bisect.bisect_left(bounds, v)] for v in values)  # the last bound is +Inf
    for bound, n in hits.items():
        pipe.hincrby(name, _bucket(bound), n)
    pipe.hincrbyfloat(name, "sum", float(sum(values)))
    pipe.hincrby(name, "count", len(values))


def record_steps(
    client: redis.Redis,
    model: str,
    worker: str,
    sizes: list[int],
    max_batch: int,
    tokens_per_second: float,
    kv_cache: tuple[int, int, int] = (0, 0, 0),
) -> None:
    """An engine's decoding steps since its last heartbeat: batch sizes and occupancy, the step
    count, its current tokens per second and its KV cache now (bytes, slots, positions per slot)."""
    with client.pipeline(transaction=False) as pipe:
        observe_many(pipe, model, "batch_size", [float(s) for s in sizes])
        observe_many(pipe, model, "batch_occupancy", [s / max_batch for s in sizes])
        if sizes:
            pipe.hincrby(keys.counters(model), "decode_steps", len(sizes))
        pipe.hset(keys.throughput(model), worker, f"{tokens_per_second:.3f}")
        pipe.hset(keys.kv_cache(model), worker, " ".join(str(int(n)) for n in kv_cache))
        pipe.execute()


def record_holds(client: redis.Redis, model: str, engine: str, seconds: list[float]) -> None:
    """nnsight jobs' holds of their engine's model (`engine`: ACTQ_NNSIGHT_ENGINE, own or shared)."""
    if seconds:
        with client.pipeline(transaction=False) as pipe:
            observe_many(pipe, model, f"nnsight_hold_{engine}", seconds)
            pipe.execute()


def tokens_per_second(client: redis.Redis, model: str, live_workers: list[str]) -> float:
    """The model's live workers' tokens per second (each over its last heartbeat interval)."""
    if not live_workers:
        return 0.0
    found = cast("list[bytes | None]", client.hmget(keys.throughput(model), live_workers))
    return sum(float(v) for v in found if v is not None)


def kv_caches(client: redis.Redis, model: str, live_workers: list[str]) -> dict[str, tuple[int, int, int]]:
    """Each live worker's KV cache at its last heartbeat: (bytes, slots, positions per slot)."""
    if not live_workers:
        return {}
    found = cast("list[bytes | None]", client.hmget(keys.kv_cache(model), live_workers))
    sizes = {}
    for worker, value in zip(live_workers, found, strict=True):
        if value is not None:
            size, slots, tokens = (int(n) for n in value.split())
            sizes[worker] = (size, slots, tokens)
    return sizes


def count_submitted(client_or_pipe, model: str, n: int = 1) -> None:
    client_or_pipe.hincrby(keys.counters(model), "submitted", n)


def read(client: redis.Redis, model: str) -> dict:
    # a bytes client (no decode_responses): fields and values come back as bytes
    found = cast("dict[bytes, bytes]", client.hgetall(keys.counters(model)))
    counters = {k.decode(): float(v) for k, v in found.items()}
    histograms = {}
    for histogram, bounds in HISTOGRAMS.items():
        found = cast("dict[bytes, bytes]", client.hgetall(keys.histogram(model, histogram)))
        raw = {k.decode(): float(v) for k, v in found.items()}
        cumulative = itertools.accumulate(raw.get(_bucket(b), 0.0) for b in bounds)
        histograms[histogram] = {
            "buckets": list(zip([_bucket(b) for b in bounds], cumulative, strict=True)),
            "sum": raw.get("sum", 0.0),
            "count": raw.get("count", 0.0),
        }
    return {"counters": counters, "histograms": histograms}

"""Job figures kept in Redis so that the API's /metrics can report what the workers saw.

Per model, one hash of counters (`succeeded`, `failed`, `cancelled`, `submitted`,
`generated_tokens`, `captured_bytes`) and one hash per histogram (`duration`: running time,
`queue_wait`: created -> started), whose fields are cumulative bucket counts plus `sum` and
`count`, in Prometheus' own layout.
"""

from __future__ import annotations

import math
from typing import cast

import redis

from shared import keys

BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, math.inf)
COUNTERS = ("submitted", "succeeded", "failed", "cancelled", "generated_tokens", "captured_bytes")
HISTOGRAMS = ("duration", "queue_wait")


def _bucket(value: float) -> str:
    return "+Inf" if math.isinf(value) else f"{value:g}"


def observe(pipe: redis.client.Pipeline, model: str, histogram: str, seconds: float) -> None:
    name = keys.histogram(model, histogram)
    for bound in BUCKETS:
        if seconds <= bound:
            pipe.hincrby(name, _bucket(bound), 1)
    pipe.hincrbyfloat(name, "sum", seconds)
    pipe.hincrby(name, "count", 1)


def count_submitted(client_or_pipe, model: str, n: int = 1) -> None:
    client_or_pipe.hincrby(keys.counters(model), "submitted", n)


def read(client: redis.Redis, model: str) -> dict:
    # a bytes client (no decode_responses): fields and values come back as bytes
    found = cast("dict[bytes, bytes]", client.hgetall(keys.counters(model)))
    counters = {k.decode(): float(v) for k, v in found.items()}
    histograms = {}
    for histogram in HISTOGRAMS:
        found = cast("dict[bytes, bytes]", client.hgetall(keys.histogram(model, histogram)))
        raw = {k.decode(): float(v) for k, v in found.items()}
        histograms[histogram] = {
            "buckets": [(_bucket(b), raw.get(_bucket(b), 0.0)) for b in BUCKETS],
            "sum": raw.get("sum", 0.0),
            "count": raw.get("count", 0.0),
        }
    return {"counters": counters, "histograms": histograms}

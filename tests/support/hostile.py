"""Hostile requests, shared by the API tests (a clear 4xx, nothing queued) and the e2e test
that measures the API's responsiveness while they arrive. Each entry: (case, JSON payload or
None, raw body or None, acceptable statuses)."""

from __future__ import annotations

from tests.support.stack import TINY


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

SIXTEEN = "{" + ",".join(map(str, range(16))) + "}"
EXPANSION_BOMB = {  # 256 patterns of 4,096 paths each: a million paths if they were built
    "model": TINY,
    "messages": [{"role": "user", "content": "hi"}],
    "capture": {"modules": [f"model.layers.{SIXTEEN}.mlp.{SIXTEEN}.up.{SIXTEEN}"] * 256},
}
HOSTILE.append(("capture expansion bomb", EXPANSION_BOMB, None, (422,)))

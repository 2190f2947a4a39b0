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
TEN = "{" + ",".join(map(str, range(10))) + "}"


def _capture(modules: list[str]) -> dict:
    return {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "capture": {"modules": modules}}


def _shifted(k: int, width: int) -> str:
    return "{" + ",".join(map(str, range(k, k + width))) + "}"


HOSTILE += [
    # 256 copies of one pattern of 4,096 paths: a million paths if they were built
    ("capture expansion bomb", _capture([f"model.layers.{SIXTEEN}.mlp.{SIXTEEN}.up.{SIXTEEN}"] * 256), None, (422,)),
    # 250 distinct patterns of 4,096 paths each (8**4): no two alike, so nothing is shared
    (
        "distinct brace patterns",
        _capture([f"model.layers.{'.'.join(_shifted(k + i, 8) for i in range(4))}.self_attn" for k in range(250)]),
        None,
        (422,),
    ),
    # 200 copies of a ten-level pattern: 10**10 paths each
    ("ten-level brace pattern", _capture(["model." + ".".join([TEN] * 10)] * 200), None, (422,)),
    # 256 distinct ten-level patterns of the longest allowed length
    (
        "distinct ten-level patterns",
        _capture([("model." + ".".join([_shifted(k, 10)] + [TEN] * 9))[:256].rsplit(".", 1)[0] for k in range(256)]),
        None,
        (422,),
    ),
    # 256 long paths that name nothing: each would ask for the closest valid names
    ("unknown long paths", _capture([f"model.layers.{k}.{'x' * 200}" for k in range(256)]), None, (422,)),
]

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


# --- the surface of tools, structured output, interventions and the OpenAI routes ------------
# Each entry: (case, path, payload, acceptable statuses); every one is refused with nothing queued.

CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def nested(kind: str, depth: int) -> dict:
    """A schema `depth` levels deep: objects whose one required property nests (`properties`),
    arrays of arrays (`items`) or a chain of `anyOf`."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        if kind == "properties":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        elif kind == "items":
            schema = {"type": "array", "items": schema}
        else:
            schema = {"anyOf": [schema, {"type": "null"}]}
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}


def tools(count: int, properties: int, prefix: str = "f") -> list[dict]:
    """`count` tools whose parameters have `properties` described enum properties (about 290
    bytes each as JSON)."""
    parameters = {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "description": "d" * 200, "enum": [f"v{j}" for j in range(5)]}
            for i in range(properties)
        },
    }
    return [{"type": "function", "function": {"name": f"{prefix}{i}", "parameters": parameters}} for i in range(count)]


def _edit(**fields: object) -> dict:
    return {**CHAT, "interventions": [{"module": "model.layers.1", **fields}]}


CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
DEEP_ARGUMENTS = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f0", "arguments": '{"a": ' + "[" * 50_000}}
        ],
    },
]
SURFACE = [
    (
        "100 tools of 27 KB schemas",
        "/v1/chat/completions",
        {**CHAT, "tools": tools(100, 90), "tool_choice": "required"},
        (413,),
    ),
    ("100 tools of 27 KB schemas", "/jobs", {**CHAT, "tools": tools(100, 90)}, (413,)),
    ("a schema 70 levels deep", "/jobs", {**CHAT, "response_format": json_schema(nested("properties", 70))}, (422,)),
    (
        "a schema 70 levels deep",
        "/v1/chat/completions",
        {**CHAT, "response_format": json_schema(nested("properties", 70))},
        (400,),
    ),
    # deeper than 200 levels the body itself is refused (400, pydantic's JSON parser); below, the schema check
    ("arrays 300 deep", "/jobs", {**CHAT, "response_format": json_schema(nested("items", 300))}, (400,)),
    ("arrays 150 deep", "/jobs", {**CHAT, "response_format": json_schema(nested("items", 150))}, (422,)),
    ("anyOf 60 deep", "/jobs", {**CHAT, "response_format": json_schema(nested("anyOf", 60))}, (422,)),
    ("anyOf 300 deep", "/v1/chat/completions", {**CHAT, "response_format": json_schema(nested("anyOf", 300))}, (400,)),
    (
        "tool parameters 100 deep",
        "/jobs",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": nested("properties", 100)}}]},
        (400,),
    ),
    (
        "tool parameters 40 deep",
        "/jobs",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": nested("properties", 40)}}]},
        (422,),
    ),
    ("a schema that is a $ref to itself", "/jobs", {**CHAT, "response_format": json_schema({"$ref": "#"})}, (422,)),
    ("$defs a -> b -> a", "/v1/chat/completions", {**CHAT, "response_format": json_schema(CYCLE)}, (400,)),
    ("project_out along a zero vector", "/jobs", _edit(op="project_out", vector=[0.0] * 64), (422,)),
    (
        "a normalized add of a zero vector",
        "/v1/chat/completions",
        _edit(op="add", vector=[0.0] * 64, normalize=True),
        (400,),
    ),
    ("a zero vector below float32's smallest", "/jobs", _edit(op="project_out", vector=[1e-50] * 64), (422,)),
    (
        "an edit window in Arabic-Indic digits",
        "/jobs",
        _edit(op="scale", factor=2.0, positions={"prompt": ["١:٣"]}),
        (422,),
    ),
    (
        "a window with a trailing newline",
        "/jobs",
        _edit(op="scale", factor=2.0, positions={"prompt": ["1:3\n"]}),
        (422,),
    ),
    (
        "parallel_tool_calls 'yes'",
        "/v1/chat/completions",
        {**CHAT, "tools": tools(1, 1), "parallel_tool_calls": "yes"},
        (400,),
    ),
    ("logprobs 'true'", "/jobs", {**CHAT, "logprobs": "true"}, (422,)),
    ("tool-call arguments 50,000 deep", "/jobs", {**CHAT, "messages": DEEP_ARGUMENTS}, (422,)),
    (
        "4 MiB of small messages",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x"}] * 100_000},
        (400,),
    ),
    (
        "a million prompt token ids",
        "/jobs",
        {"model": TINY, "prompt_token_ids": [1] * 1_000_000, "max_tokens": 4},
        (422,),
    ),
]


def _widest_schema() -> dict:
    """A response_format schema near both limits: ~99,000 characters, 62 levels deep."""
    properties: dict = {f"p{i}": {"type": "string", "maxLength": 8, "description": "d" * 200} for i in range(370)}
    properties["deep"] = nested("properties", 30)
    return {"type": "object", "properties": properties}


# The heaviest requests each kind accepts (tools and schemas at their limits, a batch near the body
# limit sharing them), for a model whose context holds them (WIDE: published, never served). Each
# is sent with an Idempotency-Key: every send is checked in full, and only the first queues a job.
WIDE = "wide"
WIDE_CHAT = {**CHAT, "model": WIDE}
HEAVIEST = [
    (
        "tools at the schema budget, a forced call",
        "/jobs",
        {**WIDE_CHAT, "tools": tools(10, 88), "tool_choice": "required"},
    ),
    (
        "tools at the schema budget, a forced call",
        "/v1/chat/completions",
        {**WIDE_CHAT, "tools": tools(10, 88), "tool_choice": "required", "actq_wait_seconds": 0.1},
    ),
    (
        "a response_format schema at the size and depth limits",
        "/jobs",
        {**WIDE_CHAT, "response_format": json_schema(_widest_schema())},
    ),
    (
        "a batch near the body limit sharing tools at the budget",
        "/jobs/batch",
        {"jobs": [{"request": {**WIDE_CHAT, "tools": tools(10, 88)}, "idempotency_key": f"k{i}"} for i in range(14)]},
    ),
]

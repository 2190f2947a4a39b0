"""Hypothesis strategies for what an OpenAPI schema cannot describe: nested JSON Schemas (with
references, cycles, unsatisfiable combinations) and edit windows."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

LEAVES: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 4},
    {"type": "string", "pattern": "^[a-c]{1,3}$"},
    {"type": "integer", "minimum": -5, "maximum": 99},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": [1, "a", None]},
    {"const": "k"},
    {"$ref": "#"},
    {"$ref": "#/$defs/d"},
    {"type": "integer", "minimum": 5, "maximum": 3},  # unsatisfiable
    {"enum": []},
    {},
]


def _object(properties: dict[str, Any], required: int, closed: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": sorted(properties)[:required]}
    if closed:
        schema["additionalProperties"] = False
    return schema


def schemas(max_leaves: int = 12) -> st.SearchStrategy[dict[str, Any]]:
    """JSON Schemas of objects, arrays, anyOf/allOf/oneOf and references (a `$defs` entry `d` is
    added at the top, itself any schema, so `#/$defs/d` may be a cycle with or without a base
    case)."""
    node = st.recursive(
        st.sampled_from(LEAVES),
        lambda inner: st.one_of(
            st.builds(
                _object,
                st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
                st.integers(0, 3),
                st.booleans(),
            ),
            st.builds(
                lambda items, least, most: {"type": "array", "items": items, "minItems": least, "maxItems": most},
                inner,
                st.integers(0, 2),
                st.integers(0, 3),
            ),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
            st.builds(lambda xs: {"allOf": xs}, st.lists(inner, min_size=1, max_size=2)),
            st.builds(lambda xs: {"oneOf": xs}, st.lists(inner, min_size=1, max_size=2)),
        ),
        max_leaves=max_leaves,
    )
    return st.builds(lambda top, d: {**top, "$defs": {"d": d}}, node, node)


def deep(schema: dict[str, Any], depth: int, kind: str) -> dict[str, Any]:
    for _ in range(depth):
        if kind == "items":
            schema = {"type": "array", "items": schema}
        elif kind == "anyOf":
            schema = {"anyOf": [schema]}
        else:
            schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """`schemas()` wrapped in 0 to 120 levels of objects, arrays or anyOf: past every limit."""
    return st.builds(deep, schemas(), st.integers(0, 120), st.sampled_from(["items", "anyOf", "properties"]))


DIGITS = "0123456789٠١٢٣٤٥٦٧٨٩０１２３"
# edit windows as a request writes them: ASCII and other digits, signs, colons, spaces, newlines;
# half of them shaped like a window ("a:b"), in any script's digits
windows = st.one_of(
    st.text(alphabet=DIGITS + "-:+ \n\t.", max_size=12),
    st.from_regex(r"\A-?[0-9٠-٩０-９]{0,3}:-?[0-9٠-٩]{0,3}\n?\Z", fullmatch=True),
)

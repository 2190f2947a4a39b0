"""Object schemas closed to unlisted keys, as OpenAI's structured outputs and xgrammar's default
strict mode read them.

JSON Schema leaves an object open: `{"properties": {"a": ...}}` allows any other key beside `a`.
A constrained reply then lets a small model invent keys (`{"operation": "add", "minimum": 0,
"title": "Result"}`), which no client that sent the schema wants. So, unless the request opts
out, every object schema that lists `properties` and says nothing about other keys (no
`additionalProperties`, `patternProperties` or `unevaluatedProperties`) gets
`additionalProperties: false` before the grammar is built. An object without `properties`
(`{"type": "object"}`, json_object mode) stays open: closing it would leave only `{}`.

Opting out: `additionalProperties: true` (or a schema) on an object keeps that object open;
`strict: false` on the response format's `json_schema` or on a function keeps its whole schema
as written. Members of an `allOf`, and an object beside a `$ref`, are left as written (closing
each part would make their intersection refuse every key the other part lists); the walk goes
on inside them.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is one schema, a map of schemas, or a list of schemas
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "unevaluatedItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any) -> Any:
    """`schema` with its listed-property objects closed (module docstring); a new value, the
    argument is not changed. Whatever is not a schema object is returned as it is."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _close(out[key], False)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"], False)
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(value, False) for name, value in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(value, False) for value in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(value, True) for value in out["allOf"]]
    lists_properties = isinstance(out.get("properties"), dict)
    if lists_properties and not in_all_of and "$ref" not in out and not any(key in out for key in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out

"""A request's JSON Schemas (tools' `parameters`, `response_format.json_schema.schema`) checked
before anything compiles them, each problem a ValueError that names the field.

The limits are explicit, so that no schema reaches code that recurses without bound (jsonschema's
metaschema check raised RecursionError near 100 levels of `properties`, llguidance's JSON reader
stops at 128 levels of nesting, and both used to surface as a bare 500):

- size: every schema of a request, as JSON, all together, at most ACTQ_MAX_SCHEMA_BYTES
  (`over_budget`, checked first and in C: `json.dumps`);
- depth: at most MAX_SCHEMA_DEPTH levels of JSON objects and arrays in one schema, measured
  without recursion (`too_deep`);
- shape: draft 2020-12's metaschema (`check_schema`).

They run at submit, on a thread off the API's event loop (api/content_checks.py); the parse of
a request checks structure only. Tool-call arguments (a JSON object written as a string) are
held to the same depth (`arguments_problem`).
"""

from __future__ import annotations

import json
from typing import Any

MAX_SCHEMA_DEPTH = 64  # levels of JSON objects and arrays in one schema, or in one call's arguments
MAX_SCHEMA_CHARS = 100_000  # one tool's parameters, or a response_format schema, as JSON


def too_deep(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> bool:
    """Whether `value` (parsed JSON) nests objects and arrays more than `limit` levels deep;
    iterative, so any depth is measured without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def json_chars(value: Any) -> int | None:
    """Characters of `value` as JSON, or None when it nests too deep to be written (RecursionError)."""
    try:
        return len(json.dumps(value))
    except RecursionError:
        return None


def check_schema(schema: Any, where: str) -> None:
    """`schema` is a JSON Schema of bounded size and depth (draft 2020-12's metaschema); a
    ValueError names `where` and what is wrong."""
    import jsonschema

    chars = json_chars(schema)
    if chars is not None and chars > MAX_SCHEMA_CHARS:
        raise ValueError(f"{where} is {chars:,} characters as JSON; one schema has at most {MAX_SCHEMA_CHARS:,}")
    if chars is None or too_deep(schema):
        raise ValueError(
            f"{where} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; flatten it, or name the "
            "repeated part once in `$defs` and `$ref` it"
        )
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise ValueError(f"{where}{path} is not a valid JSON Schema: {exc.message[:300]}") from None
    except RecursionError:  # not reached within the depth limit; never a 500 if it is
        raise ValueError(f"{where} is too deeply nested to check") from None
    if (pointer := self_reference(schema)) is not None:
        raise ValueError(
            f"{where} at {pointer!r} refers back to itself through `$ref`, `allOf`, `anyOf` or `oneOf` without "
            "reading any of the value in between, a cycle a validator follows forever (and one with no base case "
            "describes no value at all): put the reference under `properties` or `items`"
        )


# keywords whose subschemas apply to the same value as the schema that holds them
_SAME_VALUE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")
# keywords whose subschemas apply to a part of the value (or are only definitions)
_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_MANY = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _subschemas(pointer: str, node: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(pointer, subschema, applies to the same value) for each subschema `node` holds."""
    found: list[tuple[str, Any, bool]] = []
    for key in _SAME_VALUE + _ONE + ("prefixItems",) + _MANY:
        value = node.get(key)
        same = key in _SAME_VALUE
        if isinstance(value, dict) and key not in _MANY:
            found.append((f"{pointer}/{key}", value, same))
        elif isinstance(value, list):
            found += [(f"{pointer}/{key}/{i}", child, same) for i, child in enumerate(value)]
        elif isinstance(value, dict):
            found += [(f"{pointer}/{key}/{escape_token(name)}", child, False) for name, child in value.items()]
    return found


def escape_token(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def self_reference(schema: Any) -> str | None:
    """The JSON pointer of a subschema that reaches itself through `$ref`s and the keywords that
    apply to the same value (`allOf`, `anyOf`...), never descending into the value: what jsonschema
    and other validators recurse on forever. None when there is no such cycle. Local references
    (`#`, `#/$defs/...`) only; iterative."""
    edges: dict[str, list[str]] = {}
    pending: list[tuple[str, Any]] = [("", schema)]
    while pending:
        pointer, node = pending.pop()
        if pointer in edges or not isinstance(node, dict):
            continue
        targets = edges[pointer] = []
        for child_pointer, child, same in _subschemas(pointer, node):
            pending.append((child_pointer, child))
            if same:
                targets.append(child_pointer)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and (target := resolve(schema, ref[1:])) is not None:
            targets.append(ref[1:].rstrip("/"))
            pending.append((ref[1:].rstrip("/"), target))  # a target outside the known keywords, too
    return _cycle(edges)


def resolve(schema: Any, pointer: str) -> Any:
    """The part of `schema` at a JSON pointer (`/$defs/a`, "" for the root); None when there is none."""
    node = schema
    for token in pointer.split("/")[1:] if pointer else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _cycle(edges: dict[str, list[str]]) -> str | None:
    """A node on a cycle of `edges`, found by an iterative depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in edges:
        if start in state:
            continue
        stack = [(start, iter(edges.get(start, ())))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                return f"#{child}"
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(edges.get(child, ()))))
    return None


def arguments_problem(text: str) -> str | None:
    """Why a call's `arguments` text is not a JSON object of bounded depth, or None."""
    too_deep_text = f"arguments nest objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep"
    try:
        parsed = json.loads(text)
    except RecursionError:
        return too_deep_text
    except ValueError as exc:
        return f"arguments must be a JSON object written as a string; this is not JSON ({exc})"
    if not isinstance(parsed, dict):
        return f"arguments must be a JSON object written as a string, not {type(parsed).__name__}"
    # only text with that many brackets can nest that deep: the walk is skipped for the rest
    if text.count("[") + text.count("{") > MAX_SCHEMA_DEPTH and too_deep(parsed):
        return too_deep_text
    return None

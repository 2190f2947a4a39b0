"""Parts of a JSON Schema that a constrained reply can start but never finish.

A subschema "has a finite value" when some JSON value of finite size satisfies it. An object that
requires a property whose schema is itself (`{"properties": {"a": {"$ref": "#"}}, "required":
["a"]}`), directly or through `$ref`s, `allOf` and array `minItems`, has none: every value it
allows is endless. When such a part is reachable from the root (an optional property, an array
item with room for one, a branch of `anyOf`), llguidance's grammar lets the reply start it, and
from then on the reply can only go deeper until llguidance gives up ("Too many items") or the
length runs out: a schema that passed the submit check failed its job mid-reply. The root alone
was already refused (its forced prefix: shared/grammars.py); this finds the rest.

The analysis is static and conservative in one direction only: a part reported has no finite
value (so nothing is refused that a reply could finish), as a least fixpoint over the schema's
local `$ref`s. `allOf` and a `$ref` beside other keywords count as finite when every part is
(their intersection could still be empty: llguidance's own compile decides that). A schema
without `type` accepts values of every type, so it is finite whatever its object keywords say.
"""

from __future__ import annotations

from typing import Any

from shared.schema_checks import escape_token, resolve


def endless_part(schema: Any) -> str | None:
    """The JSON pointer (`#/...`) of the first part of `schema`, in breadth-first order from the
    root, that a reply can enter and whose every value is endless; None when there is none."""
    nodes: dict[str, Any] = {}
    order: list[str] = []
    reach: dict[str, list[str]] = {}
    pending = [""]
    while pending:  # breadth-first over what a reply can enter, $refs followed
        pointer = pending.pop(0)
        if pointer in nodes:
            continue
        node = resolve(schema, pointer)
        if node is None:  # a $ref to nowhere: refused as such elsewhere, not judged here
            continue
        nodes[pointer] = node
        order.append(pointer)
        reach[pointer] = _entered(pointer, node)
        pending += [p for p in reach[pointer] if p not in nodes]
    finite = {pointer: False for pointer in nodes}
    changed = True
    while changed:  # least fixpoint: a part is finite once some value of it is built from finite parts
        changed = False
        for pointer in order:
            if not finite[pointer] and _finite(pointer, nodes[pointer], finite):
                finite[pointer] = changed = True
    return next((f"#{p}" for p in order if nodes[p] is not False and not finite[p]), None)


def _ref(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref")
    return ref[1:].rstrip("/") if isinstance(ref, str) and ref.startswith("#") else None


def _entered(pointer: str, node: Any) -> list[str]:
    """The parts of `node` a reply can be inside of: properties, other keys, items (while there is
    room for one), each branch, and a `$ref`'s target."""
    if not isinstance(node, dict):
        return []
    parts: list[str] = []
    if isinstance(node.get("properties"), dict):
        parts += [f"{pointer}/properties/{escape_token(name)}" for name in node["properties"]]
    if isinstance(node.get("additionalProperties"), dict):
        parts.append(f"{pointer}/additionalProperties")
    room = node.get("maxItems")
    prefix = node.get("prefixItems")
    if isinstance(prefix, list):
        parts += [f"{pointer}/prefixItems/{i}" for i in range(len(prefix)) if not isinstance(room, int) or i < room]
    if isinstance(node.get("items"), dict) and (not isinstance(room, int) or room > len(prefix or [])):
        parts.append(f"{pointer}/items")
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            parts += [f"{pointer}/{key}/{i}" for i in range(len(node[key]))]
    if (target := _ref(node)) is not None:
        parts.append(target)
    return parts


def _finite(pointer: str, node: Any, finite: dict[str, bool]) -> bool:
    """Whether `node` has a finite value, given what is known finite so far (`finite`)."""
    if isinstance(node, bool) or not isinstance(node, dict):
        return node is not False
    known = lambda p: finite.get(p, True)  # noqa: E731 - a part not walked (a $ref to nowhere): not ours to judge
    if (target := _ref(node)) is not None and not known(target):
        return False
    members = [f"{pointer}/allOf/{i}" for i in range(len(node.get("allOf") or []))]
    if not all(known(m) for m in members):
        return False
    branches = [f"{pointer}/{key}/{i}" for key in ("anyOf", "oneOf") for i in range(len(node.get(key) or []))]
    if branches and not any(known(b) for b in branches):
        return False
    if "const" in node or node.get("enum"):
        return True
    kinds = node.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(_kind_finite(kind, pointer, node, known) for kind in kinds)


def _kind_finite(kind: str, pointer: str, node: dict[str, Any], known: Any) -> bool:
    if kind == "object":
        listed = node.get("properties")
        properties: dict[str, Any] = listed if isinstance(listed, dict) else {}
        other = node.get("additionalProperties")
        for name in node.get("required") or []:
            if name in properties:
                if not known(f"{pointer}/properties/{escape_token(name)}"):
                    return False
            elif other is False:
                return False
            elif isinstance(other, dict) and not known(f"{pointer}/additionalProperties"):
                return False
        return True
    if kind == "array":
        least = node.get("minItems") or 0
        given = node.get("prefixItems")
        prefix: list[Any] = given if isinstance(given, list) else []
        if not all(known(f"{pointer}/prefixItems/{i}") for i in range(min(least, len(prefix)))):
            return False
        items = node.get("items")
        if least > len(prefix) and (items is False or (isinstance(items, dict) and not known(f"{pointer}/items"))):
            return False
        return True
    return True

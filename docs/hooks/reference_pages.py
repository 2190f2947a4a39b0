"""MkDocs hook (mkdocs.yml `hooks:`): the CLI and HTTP reference pages, rendered from the code at
every build, so they cannot drift from it.

A page holding the line `<!-- reference: cli -->` gets, in its place, typer's own Markdown for the
`actq` command (`typer shared.cli.app utils docs`: every command, argument and option with its
help and default); `<!-- reference: http -->` gets every route of the API's OpenAPI schema
(`api.main.app.openapi()`), its parameters, its request body's fields and the schemas they name.
Both are read in a fresh process at each build, with no ACTQ_* variable set, so `mkdocs serve`
picks up a new command or request field on its next rebuild and settings never change the page.
tests/test_reference_pages.py builds the site and checks every command, option, route, parameter
and request field is on the built pages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- reference: (?P<kind>\w+) -->$", re.MULTILINE)
OPENAPI = "import json; from api.main import app; print(json.dumps(app.openapi()))"
REF = "#/components/schemas/"


def _run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTQ_")}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def cli_reference() -> str:
    """typer's Markdown for `actq`, without its title (the page has its own): `## \\`actq run\\``..."""
    text = _run("-m", "typer", "shared.cli.app", "utils", "docs", "--name", "actq")
    return text.split("\n", 1)[1].lstrip("\n")


def http_reference() -> str:
    return render_openapi(json.loads(_run("-c", OPENAPI)))


# --- OpenAPI -> Markdown -------------------------------------------------------------------------


def schema_title(ref: str) -> str:
    """`#/components/schemas/JobRequest-Input` -> `JobRequest` (pydantic's input variant)."""
    return ref.removeprefix(REF).removesuffix("-Input")


def _anchor(title: str) -> str:
    """The id MkDocs' toc gives a heading `title` (Python-Markdown's default slugify)."""
    return slugify(title, "-")


def escape(text: str) -> str:
    """Text for Markdown: `<` outside code spans would open an HTML tag and hide what follows."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def one_line(text: str) -> str:
    return escape(" ".join(text.split()))


def type_of(schema: dict[str, Any]) -> str:
    """A schema's type in a few words, a named schema as a link to its section."""
    if "$ref" in schema:
        title = schema_title(schema["$ref"])
        return f"[`{title}`](#{_anchor(title)})"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " or ".join(type_of(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return "array of " + type_of(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "object of " + type_of(schema["additionalProperties"])
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "string" and schema.get("format") == "binary":
        return "bytes"
    return kind or "any"


BOUNDS = {
    "minimum": "≥ {}",
    "exclusiveMinimum": "> {}",
    "maximum": "≤ {}",
    "exclusiveMaximum": "< {}",
    "minLength": "length ≥ {}",
    "maxLength": "length ≤ {}",
    "minItems": "≥ {} items",
    "maxItems": "≤ {} items",
    "maxProperties": "≤ {} entries",
}


def _bounds(schema: dict[str, Any]) -> list[str]:
    found = [text.format(schema[key]) for key, text in BOUNDS.items() if key in schema]
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key, []):
            found += _bounds(option)
    return found


def field(name: str, schema: dict[str, Any], required: bool, where: str | None = None) -> str:
    """One bullet: `name` (where; type; required or its default; bounds): description."""
    facts = ([where] if where else []) + [type_of(schema)]
    if required:
        facts.append("required")
    elif "default" in schema:
        facts.append(f"default `{json.dumps(schema['default'])}`")
    facts += _bounds(schema)
    line = f"* `{name}` ({'; '.join(facts)})"
    description = schema.get("description")
    return line + (f": {one_line(description)}" if description else "")


def fields(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    return [field(name, prop, name in required) for name, prop in schema.get("properties", {}).items()]


def refs(schema: Any) -> Iterator[str]:
    """Every `$ref` inside a schema, at any depth."""
    if isinstance(schema, dict):
        if isinstance(schema.get("$ref"), str):
            yield schema["$ref"]
        for value in schema.values():
            yield from refs(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from refs(value)


def request_schemas(openapi: dict[str, Any]) -> list[str]:
    """The named schemas that parameters and request bodies use, and every schema those name, in
    order of first use."""
    components = openapi.get("components", {}).get("schemas", {})
    seen: list[str] = []
    pending = [
        ref
        for ops in openapi["paths"].values()
        for op in ops.values()
        for ref in refs([op.get("parameters", []), op.get("requestBody", {})])
    ]
    while pending:
        ref = pending.pop(0)
        if ref in seen or not ref.startswith(REF):
            continue
        seen.append(ref)
        pending += list(refs(components.get(ref.removeprefix(REF), {})))
    return seen


def operation(method: str, path: str, op: dict[str, Any], components: dict[str, Any]) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        lines += [f"**{escape(op['summary'])}**", ""]
    if op.get("description"):
        lines += [escape(op["description"].strip()), ""]
    parameters = op.get("parameters", [])
    if parameters:
        lines += ["**Parameters**:", ""]
        for p in parameters:
            schema = {**p.get("schema", {}), **({"description": p["description"]} if "description" in p else {})}
            lines.append(field(p["name"], schema, p.get("required", False), where=p["in"]))
        lines.append("")
    for content_type, body in op.get("requestBody", {}).get("content", {}).items():
        schema = body.get("schema", {})
        lines += [f"**Request body** (`{content_type}`): {type_of(schema)}", ""]
        if "$ref" in schema:
            resolved = components.get(schema["$ref"].removeprefix(REF), {})
            lines += [*fields(resolved), ""]
    responses = op.get("responses", {})
    if responses:
        said = [f"`{code}` {one_line(r.get('description', ''))}".rstrip() for code, r in responses.items()]
        lines += ["**Responses**: " + "; ".join(said), ""]
    return lines


def render_openapi(openapi: dict[str, Any]) -> str:
    """Markdown for every route (grouped by tag, in the schema's order) and the request schemas."""
    components = openapi.get("components", {}).get("schemas", {})
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((method, path, op))
    lines: list[str] = []
    for tag, ops in by_tag.items():
        lines += [f"## {tag}", ""]
        lines += [f"* [`{m.upper()} {p}`](#{_anchor(f'{m} {p}')})" for m, p, _ in ops] + [""]
        for method, path, op in ops:
            lines += operation(method, path, op, components)
    lines += ["## Request schemas", ""]
    for ref in request_schemas(openapi):
        schema = components.get(ref.removeprefix(REF), {})
        lines += [f"### {schema_title(ref)}", ""]
        if schema.get("description"):
            lines += [one_line(schema["description"]), ""]
        lines += [*(fields(schema) or [f"{type_of(schema)}"]), ""]
    return "\n".join(lines)


RENDERERS = {"cli": cli_reference, "http": http_reference}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs' hook: each marker line replaced by its reference."""
    return MARKER.sub(lambda m: RENDERERS[m.group("kind")](), markdown)

"""The CLI and HTTP reference pages are the code's: the site, built as `make docs` builds it (the
hook docs/hooks/reference_pages.py renders them), shows every `actq` command with each of its
arguments and options, and every API route with each parameter and request-body field, under that
command's or route's own heading. A command, option, route or field added to the code is on the
page at the next build; a build that lost one fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command

ROOT = Path(__file__).resolve().parent.parent
REF = "#/components/schemas/"


class Sections(HTMLParser):
    """A page's `<h2>`/`<h3>` sections: heading text -> the texts of the `<code>` elements under it
    (up to the next heading of that level or above)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level
        self.found: dict[str, list[str]] = {}
        self.heading: list[str] | None = None
        self.code: list[str] | None = None
        self.current: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in {f"h{n}" for n in range(1, self.level + 1)}:
            self.heading, self.current = [], None
        elif tag == "a" and self.heading is not None and ("class", "headerlink") in attrs:
            self.heading.append("\0")  # the permalink's ¶ is not the heading's text
        elif tag == "code" and self.heading is None:
            self.code = []

    def handle_endtag(self, tag: str) -> None:
        if tag.startswith("h") and tag[1:].isdigit() and self.heading is not None:
            title = "".join(self.heading).split("\0")[0].strip()
            self.current, self.heading = (title if tag == f"h{self.level}" else None), None
            if self.current is not None:
                self.found.setdefault(self.current, [])
        elif tag == "code" and self.code is not None:
            if self.current is not None:
                self.found[self.current].append("".join(self.code))
            self.code = None

    def handle_data(self, data: str) -> None:
        for part in (self.heading, self.code):
            if part is not None:
                part.append(data)


def sections(page: Path, level: int) -> dict[str, list[str]]:
    parser = Sections(level)
    parser.feed(page.read_text())
    return parser.found


def words(codes: list[str]) -> set[str]:
    """Every word of the code spans: `--capture / --no-capture` gives both options."""
    return {w.strip("[],.") for code in codes for w in code.replace("/", " ").split()}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def commands(group: Any, prefix: str) -> list[tuple[str, Any]]:
    """Every visible command under `group`, nested groups included, by its full name (typer's
    commands: typer 0.29 ships its own copy of click, whose classes are not click's)."""
    found = []
    for name, command in group.commands.items():
        if command.hidden:
            continue
        found.append((f"{prefix} {name}", command))
        if hasattr(command, "commands"):
            found += commands(command, f"{prefix} {name}")
    return found


def test_the_cli_reference_lists_every_command_argument_and_option(site):
    from shared.cli.app import cli

    on_page = sections(site / "cli" / "index.html", 2)
    listed = commands(get_command(cli), "actq")
    assert len(listed) >= 9, listed
    missing = []
    for name, command in listed:
        if name not in on_page:
            missing.append(name)
            continue
        shown = words(on_page[name])
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            names = [param.name] if param.param_type_name == "argument" else param.opts + param.secondary_opts
            missing += [f"{name} {n}" for n in names if n not in shown]
    assert not missing, f"not on the CLI reference page: {missing}"


def test_the_http_reference_lists_every_route_parameter_and_request_field(site):
    from api.main import app

    schema = app.openapi()
    components = schema["components"]["schemas"]
    page = site / "http-api" / "index.html"
    routes = sections(page, 3)
    schemas: dict[str, dict] = {}
    missing, bodies = [], 0
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            title = f"{method.upper()} {path}"
            if title not in routes:
                missing.append(title)
                continue
            shown = words(routes[title])
            missing += [f"{title} {p['name']}" for p in operation.get("parameters", []) if p["name"] not in shown]
            for content in operation.get("requestBody", {}).get("content", {}).values():
                ref = content["schema"].get("$ref", "")
                if ref.startswith(REF):
                    bodies += 1
                    fields = components[ref.removeprefix(REF)]["properties"]
                    missing += [f"{title} body {f}" for f in fields if f not in shown]
                    schemas[ref.removeprefix(REF).removesuffix("-Input")] = fields
    assert bodies >= 6 and "messages" in schemas["ChatCompletionRequest"]  # the OpenAI fields are checked
    # the schemas that request fields name have sections of their own, each listing every field
    named = {name: shown for name, shown in routes.items() if " /" not in name}
    for name, codes in named.items():
        component = components.get(name) or components.get(f"{name}-Input")
        assert component is not None, f"a section for a schema the API lacks: {name}"
        missing += [f"schema {name} {f}" for f in component.get("properties", {}) if f not in words(codes)]
    assert {"CaptureSpec", "Intervention", "Tool"} <= set(named), sorted(named)
    assert not missing, f"not on the HTTP API reference page: {missing}"


def test_long_code_lines_wrap_on_every_page(site):
    """A long command or output wraps on screen instead of hiding behind a scrollbar (issue 47):
    every built page loads the stylesheet that says so."""
    css = (site / "stylesheets" / "extra.css").read_text()
    rule = css[css.index(".md-typeset pre > code {") :]
    assert "white-space: pre-wrap;" in rule[: rule.index("}")]
    pages = sorted(site.rglob("index.html"))
    assert len(pages) >= 15
    for page in pages:
        depth = len(page.relative_to(site).parts) - 1
        assert f'href="{"../" * depth}stylesheets/extra.css"' in page.read_text(), page

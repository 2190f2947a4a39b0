"""docs/troubleshooting.md quotes actq's own messages word for word: each quoted line (`> `...``)
is still said by the code. A message is matched against the string literals of the product, the
tests and the Makefile, an f-string's replacement fields standing for any text (`…` in the quote),
or for a module's own string constant where the field names one (`{WHERE}`)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
QUOTE = re.compile(r"^> (?P<tick>`+) ?(?P<message>.+?) ?(?P=tick)$", re.MULTILINE)
ANY = "…"


def quoted(text: str) -> list[str]:
    return [m.group("message") for m in QUOTE.finditer(text)]


def _literals(tree: ast.Module) -> list[str]:
    """Every string a module can say: its constants, and its f-strings with each field as `…`
    (or as the module-level string constant the field names)."""
    constants = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    parts.append(str(value.value))
                elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name):
                    parts.append(constants.get(value.value.id, ANY))
                else:
                    parts.append(ANY)
            found.append("".join(parts))
    return found


@cache
def said() -> tuple[str, ...]:
    """What the code says: api/, worker/, shared/, tests/ (skip reasons; not this file, whose own
    literals are made-up messages) and the Makefile's lines."""
    found = (ROOT / "Makefile").read_text().splitlines()
    for folder in ("api", "worker", "shared", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != Path(__file__).resolve():
                found += _literals(ast.parse(path.read_text(), str(path)))
    return tuple(found)


def in_the_code(message: str) -> bool:
    pattern = re.compile(".*?".join(re.escape(part) for part in message.split(ANY)), re.DOTALL)
    return any(pattern.search(text) for text in said())


def test_every_message_the_troubleshooting_page_quotes_is_in_the_code():
    messages = quoted(PAGE.read_text())
    assert len(messages) >= 20, messages
    missing = [m for m in messages if not in_the_code(m)]
    assert not missing, "quoted on docs/troubleshooting.md but said nowhere in the code:\n" + "\n".join(missing)


def test_the_check_tells_a_changed_message_from_the_real_one():
    """A real message with a word changed, or with its variable part written out where the code has
    a fixed word, is not found: the check compares words, not just the quote's shape."""
    real = "Redis (the job store and broker) cannot be reached; try again shortly"
    assert in_the_code(real) and in_the_code("cannot reach the actq API at …; point the command elsewhere with …")
    assert not in_the_code(real.replace("shortly", "later"))
    assert not in_the_code("cannot reach the actq API at …; point the command somewhere else with --api URL")
    assert quoted("> `a`\n> `` b `c` ``\nnot > `d`\n") == ["a", "b `c`"]

"""The README-examples harness (tests/support/readme.py) on a README of its own: what counts as an
example and as its output, the wildcard, and the check that no stack example escapes the test."""

from __future__ import annotations

from tests.support import readme

DOC = """
<!-- no-run: starts the stack -->
```sh
actq serve   # on 127.0.0.1:8000
```

<!-- run -->
```sh
ID=$(curl -s localhost:8000/jobs -d '{}' | jq -r .id)
```

<!-- output -->
```
{"id": "…", "status": "queued"}
```

```python
Client("http://localhost:8000")  # not marked: escapes the test
```

<!-- run -->
```python
print(1)
```
"""


def test_examples_outputs_and_unmarked_blocks(tmp_path):
    path = tmp_path / "README.md"
    path.write_text(DOC)
    found = readme.examples(path)
    assert [(e.line, e.lang) for e in found] == [(8, "sh"), (22, "python")]
    assert found[0].expected == '{"id": "…", "status": "queued"}\n' and found[1].expected is None
    assert "localhost:8000" in found[0].code
    assert readme.unmarked_stack_examples(path) == [17]


def test_the_wildcard_stands_for_any_text_within_a_line_only():
    assert readme.matches('{"id": "…", "n": 1}', '{"id": "abc-123", "n": 1}\n')
    assert not readme.matches('{"id": "…", "n": 1}', '{"id": "abc-123", "n": 2}')
    assert not readme.matches("a\n…", "a\nb\nc")  # one line each
    assert readme.matches("x (1.5)", "x (1.5)") and not readme.matches("x (1.5)", "x (105)")  # no regex


def test_the_pages_are_the_readme_then_the_nav_in_order(tmp_path):
    (tmp_path / "mkdocs.yml").write_text("nav:\n  - Home: index.md\n  - Guides:\n      - b.md\n      - A: a.md\n")
    found = readme.pages(tmp_path)
    names = [p.relative_to(tmp_path).as_posix() for p in found]
    assert names == ["README.md", "docs/index.md", "docs/b.md", "docs/a.md"]
    path = tmp_path / "docs" / "b.md"
    path.parent.mkdir()
    path.write_text(DOC)
    example = readme.examples(path)[0]
    assert example.path == path and readme.where(example, tmp_path) == "docs/b.md line 8"

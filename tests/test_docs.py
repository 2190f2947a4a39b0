"""The docs match the code: every setting is documented, CI runs the README's test command, and the
manual (docs/, an MkDocs site) lists every page and builds strictly."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {f"ACTQ_{name.upper()}" for name in Settings.model_fields}


def test_every_setting_is_in_env_example_and_the_settings_page():
    table = (ROOT / "docs" / "settings.md").read_text()
    example = (ROOT / ".env.example").read_text()
    for name in SETTINGS:
        assert f"# {name}=" in example, name
        assert f"| `{name}` |" in table, name
    assert set(re.findall(r"ACTQ_[A-Z0-9_]+", example)) == SETTINGS
    from shared.cli.app import render_env_example

    assert example == render_env_example(), "regenerate it: actq env-example > .env.example"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_docs_list_every_error_type_a_job_can_carry():
    from shared.errors import JobFailure

    sentence = 'A failed job has `error: {"type"'
    (page,) = [p for p in manual_pages() if sentence in p.read_text()]
    text = page.read_text()
    listed = text[text.index(sentence) :][:400]
    missing = [t for t in JobFailure.stored_types() if f"`{t}`" not in listed]
    assert not missing, missing


def manual_pages() -> list[Path]:
    from tests.support.readme import pages

    return pages(ROOT)


def test_mkdocs_lists_every_docs_page_and_the_readme_links_them_all():
    listed = manual_pages()[1:]
    assert sorted(listed) == sorted((ROOT / "docs").rglob("*.md")), "mkdocs.yml's nav names every docs/ page once"
    assert len(set(listed)) == len(listed)
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in listed if f"](docs/{p.relative_to(ROOT / 'docs')})" not in readme]
    assert not missing, missing
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["theme"]["name"] == "material" and config["strict"] is True and config["site_dir"] == "site"


def test_the_module_map_is_in_the_architecture_page():
    """The map of the tree (each module's one job) moved with the manual: docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for package in ("api/ ", "worker/ ", "shared/ ", "tests/ ", "bench/ "):
        assert f"\n{package}" in text, package


def test_every_operation_in_the_openapi_schema_has_its_own_id():
    """Generated clients name methods by operationId: a GET and a HEAD on one path need two."""
    from api.main import app

    ids = [op["operationId"] for path in app.openapi()["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_no_code_in_the_manual_escapes_a_pipe():
    """MkDocs' Markdown keeps a backslash inside a code span (`<\\|im_start\\|>` renders with both
    backslashes, and a copied token is wrong); its tables already ignore pipes inside backticks."""
    escaped = [
        f"{page.name}:{number}: {span}"
        for page in sorted((ROOT / "docs").glob("*.md"))
        for number, line in enumerate(page.read_text().splitlines(), start=1)
        for span in re.findall(r"`[^`]*`", line)
        if "\\|" in span
    ]
    assert not escaped, "write the pipe unescaped inside backticks:\n" + "\n".join(escaped)

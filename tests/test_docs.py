"""The docs match the code: every setting is documented, and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {f"ACTQ_{name.upper()}" for name in Settings.model_fields}


def test_every_setting_is_in_env_example_and_readme():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / ".env.example").read_text()
    for name in SETTINGS:
        assert f"# {name}=" in example, name
        assert f"`{name}`" in readme, name
    assert set(re.findall(r"ACTQ_[A-Z0-9_]+", example)) == SETTINGS
    from shared.cli import render_env_example

    assert example == render_env_example(), "regenerate it: actq env-example > .env.example"


def test_compose_sets_only_real_settings_and_names_real_entry_points():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    text = (ROOT / "docker-compose.yml").read_text()
    assert set(re.findall(r"ACTQ_[A-Z0-9_]+", text)) <= SETTINGS
    assert compose["services"]["api"]["command"][:2] == ["uvicorn", "api.main:app"]
    assert compose["services"]["worker"]["command"][:3] == ["celery", "-A", "worker.celery_app"]
    assert "appendonly" in " ".join(compose["services"]["redis"]["command"])


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()

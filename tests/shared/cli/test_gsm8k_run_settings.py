"""A results directory's settings on resume (shared/cli/gsm8k/runner.py Run): the prompt format is
one of them, and a run.json written before it existed reads as a chat run."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from shared.cli.gsm8k.runner import Run, RunSettings
from shared.errors import ToolError

CAPTURE = {"modules": ["model.layers.1"], "hook": "output", "positions": "generated", "dtype": "float16"}


def settings(**overrides) -> RunSettings:
    return RunSettings(**{"model": "tiny", "dataset": "samples", "capture": CAPTURE, "indices": [0, 1, 2], **overrides})


def test_the_resolved_prompt_format_is_saved_and_a_change_is_refused(tmp_path):
    first = Run(tmp_path, settings(prompt_format="plain"))
    assert not (tmp_path / "run.json").exists()  # written once the API has accepted the first jobs
    first.save()
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved == {"run_id": first.run_id, "settings": asdict(settings(prompt_format="plain"))}
    assert saved["settings"]["prompt_format"] == "plain"

    assert Run(tmp_path, settings(prompt_format="plain")).run_id == first.run_id
    with pytest.raises(ToolError, match=r"holds a run with other settings \(prompt_format\)"):
        Run(tmp_path, settings(prompt_format="chat"))
    with pytest.raises(ToolError, match=r"holds a run with other settings \(max_tokens, prompt_format\)"):
        Run(tmp_path, settings(prompt_format="chat", max_tokens=5))


def test_a_run_from_before_the_prompt_format_resumes_as_chat(tmp_path):
    old = asdict(settings())
    del old["prompt_format"]
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "0123abcd", "settings": old}))

    assert Run(tmp_path, settings(prompt_format="chat")).run_id == "0123abcd"
    with pytest.raises(ToolError, match=r"holds a run with other settings \(prompt_format\)"):
        Run(tmp_path, settings(prompt_format="plain"))
    # other settings are still compared as before
    with pytest.raises(ToolError, match=r"holds a run with other settings \(capture\)"):
        Run(tmp_path, settings(capture={"preset": "residual", "layers": [1, 2, 3]}))
    assert json.loads((tmp_path / "run.json").read_text())["settings"] == old  # resuming rewrites nothing

"""The command line's own words: each flag spelled once, as the manual (docs/your-own-data.md) writes it."""

from __future__ import annotations

from typer.testing import CliRunner

from shared.cli.app import cli


def test_gsm8k_flags_are_spelled_once():
    shown = CliRunner().invoke(cli, ["gsm8k", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert shown.exit_code == 0, shown.output
    assert "--no-capture" in shown.output and "--no-no-capture" not in shown.output
    assert "--capture-on" in shown.output and "--reduce" in shown.output and "--layers" in shown.output

"""`actq`: the command line. `actq run` is the main job on one machine: embedded Redis (when
ACTQ_REDIS_URL is unset), a worker with the default model, the API, a handful of GSM8K problems
with the residual stream captured, scores and probes, shutdown. `actq gsm8k` and `actq probe`
do the same against a running deployment."""

from __future__ import annotations

import typer

from shared.cli.bulk_commands import gsm8k_command, run_file_command
from shared.cli.demo_command import run
from shared.cli.env_example import render_env_example
from shared.cli.result_commands import cancel_command, export_command, probe_command
from shared.cli.stack_commands import env_example, flower, prepare_model, serve_command

__all__ = ["cli", "render_env_example"]

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_show_locals=False)

# The commands, in the order `actq --help` lists them (each defined in the module named for its group).
cli.command("run")(run)
cli.command("serve")(serve_command)
cli.command("run-file")(run_file_command)
cli.command("gsm8k")(gsm8k_command)
cli.command("probe")(probe_command)
cli.command("export")(export_command)
cli.command("cancel")(cancel_command)
cli.command("flower")(flower)
cli.command("prepare-model")(prepare_model)
cli.command("env-example")(env_example)

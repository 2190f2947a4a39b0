"""`actq`, the command line, and what only it uses.

    app.py           the commands (typer): run, gsm8k, probe, flower, prepare-model, env-example
    local_stack.py   Redis, a worker and the API as child processes on this machine
    redis_server.py  an embedded redis-server on a free loopback port
    processes.py     starting and stopping child processes
    probes.py        linear probes on captured activations (`actq probe`)
    gsm8k/           GSM8K problems and prompts, bulk runs, harness-style scoring (`actq gsm8k`)

Nothing here is imported by the API or the worker, and nothing here imports them.
"""

from __future__ import annotations

import sys

import typer

from shared.errors import ConfigurationError, ToolError


def main() -> None:
    """The `actq` console script: what the user must fix is one line on stderr and exit code 2."""
    from shared.cli.app import cli

    try:
        cli()
    except (ToolError, ConfigurationError) as exc:
        typer.echo(f"error: {exc.message}", err=True)
        sys.exit(2)

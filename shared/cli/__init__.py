"""`actq`, the command line, and what only it uses.

    app.py           the `actq` app (typer): its commands registered in the order --help lists them
    demo_command.py  `actq run`, the demo on one machine
    stack_commands.py  `actq serve`, `flower`, `prepare-model`, `env-example`
    bulk_commands.py `actq run-file` and `actq gsm8k`, the options they share, what Ctrl-C prints
    result_commands.py  `actq probe`, `export`, `cancel`
    local_stack.py   Redis, a worker and the API as child processes on this machine
    redis_server.py  an embedded redis-server on a free loopback port
    processes.py     starting and stopping child processes
    serve.py         a local stack that stays up (`actq serve`)
    batch.py         bulk runs: batch submission, progress, resume, the results directory
    captures.py      the model and the default capture of a bulk run
    remote.py        the API's URL, key and retry budget for the bulk commands, and their errors in one line
    cancel.py        a bulk run's label (metadata.run), its jobs left after Ctrl-C, `actq cancel`
    run_file.py      any JSONL prompt file as a bulk run (`actq run-file`)
    probes.py        linear probes on captured activations (`actq probe`)
    probe_data.py    a probe's rows: the jobs a source selects, each capture pooled, their labels and groups
    probe_directions.py  a two-class probe as a direction in activation space, and the file of them
    steer.py         steering sweeps: run-file and gsm8k --steer, a run per strength, steering.json/.png
    steer_options.py a sweep's options checked, its vector (a file's tensor or a set's id), its probe
    steer_report.py  each strength measured (accuracy, a probe's probability, length), steering.json/.png
    export.py        a results directory as Parquet or a Hugging Face dataset (`actq export`)
    export_jobs.py   the jobs `actq export --jobs` picks by GET /jobs filters, as export samples
    export_partial.py an export stopped by a failed fetch: the partial file it keeps, resumed by the next run
    export_reader.py where an export's tensors come from: downloaded files, else the API (a failed fetch named)
    gsm8k/           GSM8K problems and prompts, harness-style scoring (`actq gsm8k`, on batch.py)
    tool_loop.py     tool-calling conversations (gsm8k --mode with-tools, run-file tools lines): a job per turn

Nothing here is imported by the API or the worker, and nothing here imports them.
"""

from __future__ import annotations

import signal
import sys

import typer

from shared.errors import ConfigurationError, ToolError


def main() -> None:
    """The `actq` console script: what the user must fix is one line on stderr and exit code 2."""
    from shared.cli.app import cli

    # A shell without job control (a script, CI) starts a background command with SIGINT ignored,
    # and Python then leaves it ignored: `kill -INT` would not stop `actq serve` or a bulk run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cli()
    except (ToolError, ConfigurationError) as exc:
        typer.echo(f"error: {exc.message}", err=True)
        sys.exit(2)

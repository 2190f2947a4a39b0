"""The commands that run or prepare actq's processes: `actq serve` (a local stack that stays up),
`actq flower` (the Celery dashboard), `actq prepare-model` and `actq env-example`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import typer

from shared.cli import serve
from shared.cli.env_example import render_env_example
from shared.settings import Settings


def serve_command(
    port: int = typer.Option(8000, help="Port for the API."),
    host: str = typer.Option("127.0.0.1", help="Address the API listens on (0.0.0.0: every interface)."),
    model: str | None = typer.Option(
        None, help="The model: the built-in smollm2-135m, a Hugging Face id or a local folder (default ACTQ_MODEL)."
    ),
    data_dir: Path = typer.Option(
        serve.DEFAULT_DATA_DIR, help="Where Redis keeps its data, activations are stored and logs go."
    ),
    storage: str | None = typer.Option(
        None, help="Where activations go instead of DATA_DIR/store: file:///abs/dir or s3://bucket/prefix."
    ),
    redis_url: str | None = typer.Option(
        None, help="Use this Redis instead of starting one (actq serve never uses ACTQ_REDIS_URL unasked)."
    ),
    start_timeout: float = typer.Option(900.0, help="Seconds to wait for the worker to load its model."),
) -> None:
    """A local stack that stays up: Redis, a worker and the API on 127.0.0.1:8000, in the
    foreground with their logs; Ctrl-C stops all of it. Jobs and files are kept in DATA_DIR for
    the next start."""
    try:
        serve.serve(
            port=port,
            host=host,
            model=model,
            data_dir=data_dir,
            storage=storage,
            redis_url=redis_url,
            start_timeout=start_timeout,
            say=typer.echo,
        )
    except KeyboardInterrupt:
        typer.echo("stopped: worker, API and Redis (jobs and files are kept in the data directory)")


FLOWER_TASK_COLUMNS = "name,uuid,state,kwargs,exception,received,runtime,worker"


def flower(
    port: int = typer.Option(5555, help="Port for the dashboard."),
    address: str = typer.Option("0.0.0.0", help="Address to listen on."),
    unauthenticated: bool = typer.Option(False, help="Run without basic auth (only on a trusted network)."),
) -> None:
    """Flower, the Celery dashboard, on the configured broker, with basic auth from ACTQ_FLOWER_BASIC_AUTH."""
    settings = Settings()
    args = [
        sys.executable,
        "-m",
        "celery",
        f"--broker={settings.redis_url}",
        "flower",
        f"--port={port}",
        f"--address={address}",
        # the tasks page: what identifies each job (its kwargs: model, kind, prompt start, run label)
        # and how it ended (state; a failed job's exception names its error), beside the defaults
        f"--tasks_columns={FLOWER_TASK_COLUMNS}",
    ]
    if settings.flower_basic_auth:
        if ":" not in settings.flower_basic_auth:
            raise typer.BadParameter("ACTQ_FLOWER_BASIC_AUTH must be user:password")
        args.append(f"--basic-auth={settings.flower_basic_auth}")
    elif not unauthenticated:
        raise typer.BadParameter(
            "set ACTQ_FLOWER_BASIC_AUTH=user:password (or pass --unauthenticated on a trusted network)"
        )
    os.execv(sys.executable, args)


def prepare_model() -> None:
    """Convert the built-in model into ACTQ_MODEL_CACHE_DIR now (the worker otherwise does it on first start)."""
    # The worker's own code does it, in a process of its own: the CLI never imports worker/.
    done = subprocess.run([sys.executable, "-m", "worker.model.loading"], check=False)
    if done.returncode:
        raise typer.Exit(done.returncode)


def env_example() -> None:
    """Print every setting with its default and meaning, in .env format (how .env.example is made)."""
    typer.echo(render_env_example(), nl=False)

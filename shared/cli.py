"""`actq`: the command line. `actq run` is the one-machine demo: embedded Redis (when
ACTQ_REDIS_URL is unset), a worker with the default model, the API, one captured job, shutdown."""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import typer

from shared import stack
from shared.redis_server import RedisServer, free_port
from shared.settings import Settings

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)

TERMINAL = ("succeeded", "failed", "cancelled")
DEFAULT_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def spread_layers(num_layers: int, count: int = 3) -> list[int]:
    """`count` layer indices spread over the depth (quarter, half, three quarters for 3)."""
    return sorted({max(0, min(num_layers - 1, round(num_layers * (i + 1) / (count + 1)))) for i in range(count)})


@cli.command()
def run(
    prompt: str = typer.Option(DEFAULT_PROMPT, help="The user message."),
    max_tokens: int = typer.Option(48, help="Tokens to generate."),
    start_timeout: float = typer.Option(900.0, help="Seconds to wait for the worker (the first run converts the model)."),
) -> None:
    """Start Redis (embedded unless ACTQ_REDIS_URL is set), a worker and the API; run one chat job
    capturing three layers' residual stream at every token; print the result; stop everything."""
    settings = Settings()
    model = settings.served_model_name
    with ExitStack() as cleanup, tempfile.TemporaryDirectory(prefix="actq-run-") as tmp:
        env: dict[str, str] = {}
        if "redis_url" not in settings.model_fields_set:
            server = cleanup.enter_context(RedisServer(Path(tmp) / "redis"))
            env["ACTQ_REDIS_URL"] = server.url
            typer.echo(f"embedded Redis on {server.url}")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        logs = [Path(tmp) / "worker.log", Path(tmp) / "api.log"]
        worker = stack.start_worker(env, logs[0])
        cleanup.callback(stack.stop, worker)
        api = stack.start_api(env, logs[1], port)
        cleanup.callback(stack.stop, api)
        typer.echo(f"worker loading {settings.model} (the first run converts it once, ~30 s); API on {base}")
        stack.wait_ready(base, model, [worker, api], start_timeout, logs)
        with httpx.Client(base_url=base, timeout=60) as client:
            info = next(m for m in client.get("/models").json() if m["name"] == model)
            layers = spread_layers(info["num_layers"])
            spec = f"model.layers.{{{','.join(map(str, layers))}}}"
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "capture": {"modules": [spec], "hook": "output", "positions": "all", "dtype": "float32"},
            }
            response = client.post("/jobs", json=body)
            if response.status_code != 202:
                raise typer.Exit(_fail(f"POST /jobs answered {response.status_code}: {response.text}"))
            job_id = response.json()["id"]
            typer.echo(f"job {job_id} queued, capturing {spec} output at every position")
            started = time.monotonic()
            # Long poll: the API answers as soon as the worker records the job.
            while (job := client.get(f"/jobs/{job_id}", params={"wait": 20}).json())["status"] not in TERMINAL:
                pass
            if job["status"] != "succeeded":
                raise typer.Exit(_fail(f"job {job['status']}: {job.get('error')}"))
        result, activations = job["result"], job["activations"]
        typer.echo(f"\ncompletion ({job['status']} in {time.monotonic() - started:.1f}s, finish_reason={result['finish_reason']}, usage={result['usage']}):")
        typer.echo(f"  {result['text'].strip()}\n")
        typer.echo("activations:")
        for tensor in activations["tensors"]:
            typer.echo(f"  {tensor['name']:<24} shape={tensor['shape']} {tensor['dtype']} rows=token_ids[{tensor['start']}:{tensor['stop']}]")
        typer.echo(f"file: {activations['uri'].removeprefix('file://')}")
        typer.echo(f"sha256: {activations['sha256']}")
        typer.echo("stopping worker, API and Redis")


def _fail(message: str) -> int:
    typer.echo(message, err=True)
    return 1


@cli.command("prepare-model")
def prepare_model() -> None:
    """Convert the built-in model into ACTQ_MODEL_CACHE_DIR now (the worker otherwise does it on first start)."""
    from worker.models import resolve_source

    typer.echo(resolve_source(Settings()))


@cli.command("env-example")
def env_example() -> None:
    """Print every setting with its default and meaning, in .env format (how .env.example is made)."""
    typer.echo(render_env_example(), nl=False)


def render_env_example() -> str:
    lines = [
        "# Every actq setting with its default. Copy to .env (read from the working directory) or export",
        "# the variables; uncomment what you change. When ACTQ_REDIS_URL is unset, `actq run` starts an",
        "# embedded Redis. S3 credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID, ...).",
        "# Generated by `actq env-example`.",
        "",
    ]
    home_defaults = {"storage_url": "file:///home/you/.local/share/actq", "model_cache_dir": "/home/you/.cache/actq/models"}
    for name, field in Settings.model_fields.items():
        default = home_defaults.get(name, "" if field.default is None else field.default)
        lines += [f"# {field.description}", f"# ACTQ_{name.upper()}={default}", ""]
    return "\n".join(lines)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

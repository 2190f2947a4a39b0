"""`actq`: the command line. `actq run` is the one-machine demo: embedded Redis (when
ACTQ_REDIS_URL is unset), a worker with the default model, the API, one captured job, shutdown."""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import typer

from shared import stack
from shared.gsm8k import spread_layers
from shared.redis_server import RedisServer, free_port
from shared.settings import Settings

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_show_locals=False)

TERMINAL = ("succeeded", "failed", "cancelled")
DEFAULT_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


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


@cli.command("gsm8k")
def gsm8k_command(
    out: Path = typer.Option(..., "--out", "-o", help="Results directory; run again with the same one to resume."),
    dataset: str = typer.Option("hub", help="`hub` (openai/gsm8k, needs `datasets`), `samples` (a dozen built-in problems) or a JSONL path."),
    split: str = typer.Option("test", help="Hub split."),
    train: str | None = typer.Option(None, help="Train split JSONL for cot-8shot exemplars (default: train.jsonl beside --dataset, or the hub's)."),
    limit: int | None = typer.Option(None, min=1, help="Run this many problems (after --offset)."),
    offset: int = typer.Option(0, min=0),
    sample: int | None = typer.Option(None, min=1, help="A random sample of this many problems instead of a slice."),
    seed: int = typer.Option(0, help="Seed for --sample."),
    style: str = typer.Option("zero-shot", help="zero-shot or cot-8shot."),
    model: str | None = typer.Option(None, help="Model name (default: the one model live workers serve)."),
    max_tokens: int = typer.Option(256, min=1),
    temperature: float = typer.Option(0.0, min=0.0, max=2.0),
    module: list[str] | None = typer.Option(None, "--module", help="Capture this module path (repeatable); default: the residual preset."),
    no_capture: bool = typer.Option(False, help="Plain completions, no activations."),
    positions: str = typer.Option("generated", help="all, prompt, generated or last."),
    dtype: str = typer.Option("float16", help="float32, float16 or bfloat16."),
    download: bool = typer.Option(False, help="Also download each problem's activations into OUT/activations/."),
    api: str | None = typer.Option(None, help="API base URL (default ACTQ_API_URL)."),
    quiet: bool = typer.Option(False, help="No progress bar."),
) -> None:
    """Run a model over GSM8K through the queue, capturing the residual stream, and score it."""
    summary = run_gsm8k(**{k: v for k, v in locals().items()})
    typer.echo(json.dumps({k: summary[k] for k in ("problems", "finished", "succeeded", "failed", "accuracy")}))


def run_gsm8k(*, out, dataset, split="test", train=None, limit=None, offset=0, sample=None, seed=0, style="zero-shot",
              model=None, max_tokens=256, temperature=0.0, module=None, no_capture=False, positions="generated",
              dtype="float16", download=False, api=None, quiet=False) -> dict:  # fmt: skip
    from shared import gsm8k
    from shared.client import Client
    from shared.gsm8k_run import Run, RunSettings, execute

    problems = gsm8k.select(gsm8k.load(dataset, split), offset=offset, limit=limit, sample=sample, seed=seed)
    exemplars = None
    if style == "cot-8shot":
        if train is None and dataset not in ("hub", "samples"):
            train = str(Path(dataset).expanduser().with_name("train.jsonl"))
        exemplars = gsm8k.fewshot_exemplars(gsm8k.load(train or dataset, "train"))
    with Client(api or Settings().api_url, timeout=60) as client:
        served = client.models()
        if model is None:
            if len(served) != 1:
                raise typer.BadParameter(f"name a --model; live models: {', '.join(m['name'] for m in served) or 'none'}")
            model = served[0]["name"]
        info = next((m for m in served if m["name"] == model), None)
        capture = None
        if not no_capture:
            if module:
                modules = list(module)
            elif info is not None:
                modules = gsm8k.residual_preset(info["num_layers"])
            else:
                raise typer.BadParameter(f"no live worker serves {model!r}, so its layer count is unknown; give --module")
            capture = {"modules": modules, "hook": "output", "positions": positions, "dtype": dtype}
        settings = RunSettings(model=model, dataset=dataset, split=split, style=style, max_tokens=max_tokens,
                               temperature=temperature, capture=capture, indices=[p.index for p in problems])  # fmt: skip
        run = Run(Path(out), settings)
        try:
            return execute(client, run, problems, exemplars, download=download, quiet=quiet)
        except KeyboardInterrupt:
            typer.echo(f"\ninterrupted: finished problems are saved in {out}; run the same command to resume", err=True)
            raise typer.Exit(130) from None


@cli.command("probe")
def probe_command(
    results: Path = typer.Argument(..., help="A results directory from `actq gsm8k`."),
    label: str = typer.Option("correct.flexible", help="What to predict: a dotted path into each sample's JSON."),
    folds: int = typer.Option(5, min=2),
    api: str | None = typer.Option(None, help="API base URL for activations not downloaded (default ACTQ_API_URL)."),
) -> None:
    """Train a logistic-regression probe per capture point and pooling; write probes.json and probes.png."""
    report = run_probes(results, label=label, folds=folds, api=api)
    for probe in report["probes"]:
        score = probe.get("skipped") or f"balanced accuracy {probe['balanced_accuracy_mean']:.3f} ± {probe['balanced_accuracy_std']:.3f}"
        typer.echo(f"{probe['point']:<44} {probe['pooling']:<15} {score}")
    typer.echo(f"wrote {results / 'probes.json'} and {results / 'probes.png'}")


def run_probes(results: Path, label: str = "correct.flexible", folds: int = 5, api: str | None = None) -> dict:
    from shared import probes
    from shared.client import Client

    with Client(api or Settings().api_url, timeout=60) as client:

        def fetch(sample: dict, name: str):
            return client.job(sample["job_id"]).tensor(name).float().numpy()

        return probes.run(results, label=label, fetch=fetch, folds=folds)


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

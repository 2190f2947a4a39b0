"""`actq`: the command line. `actq run` is the main job on one machine: embedded Redis (when
ACTQ_REDIS_URL is unset), a worker with the default model, the API, a handful of GSM8K problems
with the residual stream captured, scores and probes, shutdown. `actq gsm8k` and `actq probe`
do the same against a running deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import typer

from shared.cli import cancel, local_stack, probes, remote, serve, steer
from shared.cli.env_example import render_env_example
from shared.cli.gsm8k import data, runner
from shared.settings import Settings

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_show_locals=False)


@cli.command()
def run(
    problems: int = typer.Option(8, min=1, help="How many GSM8K problems the model answers."),
    max_tokens: int = typer.Option(160, min=1, help="Tokens to generate per problem."),
    probe_problems: int = typer.Option(
        48, min=4, help="Problems whose gold and corrupted solutions are traced for the probes."
    ),
    out: Path | None = typer.Option(None, help="Results directory (default actq-results/demo-<time>)."),
    start_timeout: float = typer.Option(
        900.0, help="Seconds to wait for the worker (the first run converts the model)."
    ),
    steer_coeffs: str = typer.Option(
        "-0.25,0,0.25",
        help="Strengths at which the answers are steered along the best probe's direction, as fractions of the "
        "residual stream's norm (--normalize); empty: no steering.",
    ),
) -> None:
    """The main job on one machine: start Redis (embedded unless ACTQ_REDIS_URL is set), a worker
    with the default model and the API; the model answers a handful of GSM8K problems with its
    residual stream captured (OUT/answers); then trace jobs read gold solutions and the same
    solutions with a wrong final answer (OUT/gold-vs-corrupted: every layer's residual stream at
    the end of the answer, reduced by the worker to one row) and a probe per layer learns to tell
    them apart; then the problems are answered again with the best probe's direction added at its
    layer, at a few strengths (OUT/steered: accuracy against strength, steering.png); print where
    everything is; stop everything."""
    settings = Settings()
    coeffs = [steer.parse_coeff(c) for c in steer_coeffs.split(",") if c.strip()]
    out = out or Path("actq-results") / time.strftime("demo-%Y%m%d-%H%M%S")
    try:
        data.load("hub")
        dataset, probe_dataset = "hub", "hub"
    except data.DatasetUnavailable as exc:
        dataset, probe_dataset = "samples", "synthetic"
        typer.echo(
            f"GSM8K from the hub is not available here ({exc}); the model answers actq's own sample problems "
            "and the probes read templated arithmetic problems in GSM8K's format"
        )
    # The jobs' own store is temporary (unless ACTQ_STORAGE_URL is set): every file is downloaded into OUT.
    with local_stack.local_stack(settings, start_timeout, say=typer.echo, temporary_store=True) as local:
        base = local.base_url
        typer.echo(f"1/3: {problems} problems answered by {settings.served_model_name}")
        summary = runner.run(
            out=out / "answers",
            dataset=dataset,
            limit=problems,
            model=settings.served_model_name,
            max_tokens=max_tokens,
            download=True,
            api=base,
        )
        typer.echo(f"2/3: gold and corrupted solutions of {probe_problems} problems, traced")
        runner.run(
            out=out / "gold-vs-corrupted",
            dataset=probe_dataset,
            limit=probe_problems,
            model=settings.served_model_name,
            capture_on="gold,corrupted",
            layers="all",
            reduce="last",
            dtype="float32",
            download=True,
            api=base,
        )
        report = probes.run_with_api(out / "gold-vs-corrupted", api=base, source="all")
        trained = [p for p in report["probes"] if "skipped" not in p and p.get("direction")]
        steered = None
        if trained and coeffs:
            best = max(trained, key=lambda p: p["balanced_accuracy_mean"])
            shown = ", ".join(steer.coeff_label(c) for c in coeffs)
            typer.echo(
                f"3/3: the {problems} problems again, {best['point']}'s probe direction added there "
                f"(coeff {shown} times the residual stream's norm)"
            )
            directions = out / "gold-vs-corrupted" / probes.DIRECTIONS_FILE
            options = steer.Options(str(directions), best["point"], coeffs, name=best["direction"], normalize=True)
            steered = runner.run(
                out=out / "steered",
                dataset=dataset,
                limit=problems,
                model=settings.served_model_name,
                max_tokens=max_tokens,
                no_capture=True,
                api=base,
                steer_options=options,
            )
        typer.echo("stopping worker, API and Redis")
    accuracy = summary["accuracy"]
    typer.echo(
        f"\n{summary['succeeded']}/{summary['problems']} problems answered by {settings.served_model_name} "
        f"({summary['tokens_per_second_this_invocation']} generated tokens/s)"
    )
    typer.echo(f"accuracy: strict {accuracy['strict']:.3f}, flexible {accuracy['flexible']:.3f}")
    typer.echo(f"answers: {out / 'answers' / 'results.jsonl'} (activations in {out / 'answers' / 'activations'})")
    trained = [p for p in report["probes"] if "skipped" not in p]
    if trained:
        best = max(trained, key=lambda p: p["balanced_accuracy_mean"])
        first = min(trained, key=lambda p: p["layer"] if p["layer"] is not None else -1)
        typer.echo(
            f"probes for 'is this solution's final answer right?' ({report['n_samples']} traces, chance "
            f"{best['majority_balanced_accuracy']:.2f}): {first['point']} {first['balanced_accuracy_mean']:.3f}, "
            f"best {best['point']} {best['balanced_accuracy_mean']:.3f} ± {best['balanced_accuracy_std']:.3f}"
        )
    else:
        reason = report["probes"][0]["skipped"] if report["probes"] else "no capture points"
        typer.echo(f"probes: not trained ({reason})")
    typer.echo(f"probe plot: {out / 'gold-vs-corrupted' / 'probes.png'}")
    if steered is not None:
        by_coeff = ", ".join(f"{steer.coeff_label(r['coeff'])}: {r['flexible']:.3f}" for r in steered["strengths"])
        typer.echo(f"steered at {steered['module']}, flexible accuracy by coeff: {by_coeff}")
        typer.echo(f"steering plot: {out / 'steered' / 'steering.png'}")


@cli.command("serve")
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


# Options `actq run-file` and `actq gsm8k` share (what to capture, where the API is).
MODEL_OPTION = typer.Option(None, help="Model name (default: the one model live workers serve).")
MODULE_OPTION = typer.Option(
    None,
    "--module",
    help="Capture this module path (repeatable); default: the model's residual preset (each decoder "
    "block's output) at three blocks spread over the depth.",
)
NO_CAPTURE_OPTION = typer.Option(False, "--no-capture", help="Plain completions, no activations.")
POSITIONS_OPTION = typer.Option(
    "generated", help="all, prompt, generated or last (trace jobs capture `completion` for generated)."
)
DTYPE_OPTION = typer.Option("float16", help="float32, float16 or bfloat16.")
LAYERS_OPTION = typer.Option("spread", help="Residual blocks to capture: spread (three), all, or indices like 0,6,-1.")
REDUCE_OPTION = typer.Option("none", help="none, or reduce each capture server-side: mean, sum, max or last.")
API_OPTION = typer.Option(None, help="API base URL (default ACTQ_API_URL).")
API_KEY_OPTION = typer.Option(
    None, "--api-key", help="API key sent as `Authorization: Bearer` (default ACTQ_API_KEY).", show_default=False
)
QUIET_OPTION = typer.Option(False, help="No progress bar.")
RETRY_OPTION = typer.Option(
    remote.DEFAULT_SECONDS,
    "--retry-timeout",
    min=0,
    help="Seconds one request to the API keeps being retried through an outage (answers 429, 502, 503, 504, "
    "a lost connection; each retry said on stderr) before the command gives up; 0: never retry.",
)
STEER_OPTION = typer.Option(
    None,
    "--steer",
    help="Steer the run: a safetensors file of vectors (e.g. `actq probe`'s probe-directions.safetensors, "
    "uploaded with POST /vectors) or a vector-set id; the whole run goes once per --coeff, into OUT/steer/coeff=C/, "
    "with OUT/steering.json and OUT/steering.png.",
)
AT_OPTION = typer.Option(None, "--at", help="With --steer: the module whose output the vector is added to.")
COEFF_OPTION = typer.Option(
    None, "--coeff", help="With --steer: a strength, repeatable; 0 runs without the edit (the reference)."
)
STEER_NAME_OPTION = typer.Option(
    None, "--steer-name", help="With --steer: the tensor to use (default: the one named like --at, or the only one)."
)
NORMALIZE_OPTION = typer.Option(
    False, "--normalize", help="With --steer: scale the vector to each activation's norm (--coeff: a fraction of |x|)."
)


def _interrupted(exc: KeyboardInterrupt, what: str, out: Path) -> NoReturn:
    """Ctrl-C in a bulk run: what is kept, and the jobs it leaves on the queue with the command
    that cancels them (shared/cli/cancel.py); exit 130."""
    typer.echo(f"\ninterrupted: finished {what} are saved in {out}; run the same command to resume", err=True)
    if isinstance(exc, cancel.Interrupted):
        typer.echo(exc.report(), err=True)
    raise typer.Exit(130) from None


def _steering_done(content: dict, out: Path) -> None:
    for row in content["strengths"]:
        shown = {k: row.get(k) for k in ("coeff", "n", "metric", "strict", "flexible", "edited_positions") if k in row}
        typer.echo(json.dumps(shown))
    typer.echo(f"wrote {out / 'steering.json'} and {out / 'steering.png'} ({content['metric']} by coeff)")


@cli.command("run-file")
def run_file_command(
    prompts: Path = typer.Argument(
        ...,
        help="A JSONL file: one object a line with `prompt` or `messages`, optionally `id` and job fields "
        "(mode, max_tokens, temperature, top_p, seed, stop, logprobs, top_logprobs); other fields are labels.",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Results directory; run again with the same one to resume."),
    model: str | None = MODEL_OPTION,
    max_tokens: int = typer.Option(256, min=1, help="For lines that do not set their own."),
    temperature: float = typer.Option(0.0, min=0.0, max=2.0, help="For lines that do not set their own."),
    module: list[str] | None = MODULE_OPTION,
    no_capture: bool = NO_CAPTURE_OPTION,
    positions: str = POSITIONS_OPTION,
    dtype: str = DTYPE_OPTION,
    layers: str = LAYERS_OPTION,
    reduce: str = REDUCE_OPTION,
    download: bool = typer.Option(False, help="Also download each line's activations into OUT/activations/."),
    api: str | None = API_OPTION,
    api_key: str | None = API_KEY_OPTION,
    quiet: bool = QUIET_OPTION,
    mode: str = typer.Option("generate", help="generate or trace: the mode of lines that do not set their own `mode`."),
    steer_vectors: str | None = STEER_OPTION,
    at: str | None = AT_OPTION,
    coeff: list[str] | None = COEFF_OPTION,
    steer_name: str | None = STEER_NAME_OPTION,
    normalize: bool = NORMALIZE_OPTION,
    probe: str | None = typer.Option(
        None,
        "--probe",
        help="With --steer: measure each strength by this probe, FILE[:NAME] of a probe-directions.safetensors "
        "(the mean probability of its positive class; its module is added to the capture); default: mean "
        "generated tokens.",
    ),
    max_turns: int = typer.Option(
        4, min=1, help="Lines with `tools` (the calculator): the most turns (jobs) of each line's conversation."
    ),
    retry_timeout: float = RETRY_OPTION,
) -> None:
    """Run every prompt of a JSONL file through the queue, capturing activations, with live progress;
    run it again with the same --out to resume (finished lines are kept, queued jobs are not sent twice)."""
    options = dict(locals())
    for name in ("steer_vectors", "at", "coeff", "steer_name", "normalize", "probe"):
        options.pop(name)
    from shared.cli import run_file, steer

    steering = steer.options(steer_vectors, at, coeff, steer_name, normalize, probe)
    try:
        summary = run_file.run(**options, steer_options=steering)
    except KeyboardInterrupt as exc:
        _interrupted(exc, "prompts", out)
    if steering is not None:
        _steering_done(summary, out)
        return
    typer.echo(json.dumps({k: summary[k] for k in ("prompts", "finished", "succeeded", "failed")}))


@cli.command("gsm8k")
def gsm8k_command(
    out: Path = typer.Option(..., "--out", "-o", help="Results directory; run again with the same one to resume."),
    dataset: str = typer.Option(
        "hub",
        help="`hub` (openai/gsm8k, needs `datasets`), `samples` (a dozen built-in problems), `synthetic` "
        "(templated arithmetic problems in GSM8K's format) or a JSONL path.",
    ),
    split: str = typer.Option("test", help="Hub split."),
    train: str | None = typer.Option(
        None, help="Train split JSONL for cot-8shot exemplars (default: train.jsonl beside --dataset, or the hub's)."
    ),
    limit: int | None = typer.Option(None, min=1, help="Run this many problems (after --offset)."),
    offset: int = typer.Option(0, min=0),
    sample: int | None = typer.Option(None, min=1, help="A random sample of this many problems instead of a slice."),
    seed: int = typer.Option(0, help="Seed for --sample."),
    style: str = typer.Option(
        "zero-shot", help="zero-shot (question and instruction), cot-8shot, or bare (the question alone)."
    ),
    prompt_format: str = typer.Option(
        "auto",
        help="chat (`messages`, rendered with the model's chat template), plain (a raw 'Question: ... Answer:' "
        "text prompt, for base models) or auto: chat when the model has a chat template, else plain.",
    ),
    model: str | None = MODEL_OPTION,
    max_tokens: int = typer.Option(256, min=1),
    temperature: float = typer.Option(0.0, min=0.0, max=2.0),
    module: list[str] | None = MODULE_OPTION,
    no_capture: bool = NO_CAPTURE_OPTION,
    positions: str = POSITIONS_OPTION,
    dtype: str = DTYPE_OPTION,
    layers: str = LAYERS_OPTION,
    reduce: str = REDUCE_OPTION,
    capture_on: str = typer.Option(
        "generated",
        help="What to run and capture, comma-separated: generated (the model's answer), gold (a trace job over "
        "the gold solution), corrupted (a trace over it with a wrong final answer).",
    ),
    download: bool = typer.Option(False, help="Also download each problem's activations into OUT/activations/."),
    api: str | None = API_OPTION,
    api_key: str | None = API_KEY_OPTION,
    quiet: bool = QUIET_OPTION,
    steer_vectors: str | None = STEER_OPTION,
    at: str | None = AT_OPTION,
    coeff: list[str] | None = COEFF_OPTION,
    steer_name: str | None = STEER_NAME_OPTION,
    normalize: bool = NORMALIZE_OPTION,
    mode: str = typer.Option(
        "no-tools",
        help="no-tools (one job per problem) or with-tools: each problem a conversation with a calculator tool, "
        "a job per turn, the model's calls answered and fed back (OUT/trajectories/<n>.jsonl).",
    ),
    max_turns: int = typer.Option(4, min=1, help="With --mode with-tools: the most turns (jobs) per problem."),
    tool_choice: str = typer.Option(
        "auto",
        help="With --mode with-tools: the first turn's tool_choice, auto (the model decides) or required (it must "
        "call the calculator, by constrained decoding); later turns are auto.",
    ),
    retry_timeout: float = RETRY_OPTION,
) -> None:
    """Run a model over GSM8K through the queue, capturing the residual stream, and score it. Works
    on any architecture (the capture is the model's `residual` preset) and on base models
    (`--prompt-format auto` sends a plain prompt to a model without a chat template). With --steer,
    once per --coeff: accuracy against the steering strength. With --mode with-tools, the model
    may call a calculator: summary.json adds turns and tool calls per problem."""
    options = dict(locals())
    for name in ("steer_vectors", "at", "coeff", "steer_name", "normalize"):
        options.pop(name)
    steering = steer.options(steer_vectors, at, coeff, steer_name, normalize)
    try:
        summary = runner.run(**options, steer_options=steering)
    except KeyboardInterrupt as exc:
        _interrupted(exc, "problems", out)
    if steering is not None:
        _steering_done(summary, out)
        return
    shown = ("problems", "finished", "succeeded", "failed", "accuracy")
    tools = summary.get("tools")
    extra = {k: tools[k] for k in ("turns_per_item_mean", "tool_calls_per_item_mean")} if tools else {}
    typer.echo(json.dumps({**{k: summary[k] for k in shown}, **extra}))


@cli.command("probe")
def probe_command(
    results: Path = typer.Argument(..., help="A results directory from `actq gsm8k` or `actq run-file`."),
    label: str = typer.Option(
        probes.LABEL_DEFAULT,
        help="What to predict: answer_correct (is the answer's final number right), a label column of a "
        "prompt file (a line's extra field), or a dotted path into each sample's JSON (a trace's own fields first).",
    ),
    source: str = typer.Option(
        probes.SOURCE_DEFAULT,
        help="Which captures: sample (each sample's own job: a problem's answer, a prompt line's job), generated "
        "or trace (own jobs of that kind), gold, corrupted (GSM8K traces), or all (every job, one row each).",
    ),
    group_by: str | None = typer.Option(
        None,
        "--group-by",
        help="Keep samples with the same value of this field (a label column or a dotted path) in one fold "
        "(default: each problem or prompt line is its own group).",
    ),
    folds: int = typer.Option(5, min=2),
    api: str | None = typer.Option(None, help="API base URL for activations not downloaded (default ACTQ_API_URL)."),
    api_key: str | None = API_KEY_OPTION,
    turns: str = typer.Option(
        probes.TURNS_DEFAULT,
        help="A tool run's turns (gsm8k --mode with-tools): last (the answer's job), first (the turn that read the "
        "question), or all (one row per turn).",
    ),
    versus: Path | None = typer.Option(
        None,
        "--versus",
        help="Another results directory (e.g. the same problems without tools): predict which run a row comes "
        "from; writes RESULTS/versus-<its name>/.",
    ),
    retry_timeout: float = RETRY_OPTION,
) -> None:
    """Train a logistic-regression probe per capture point and pooling; write probes.json and probes.png."""
    with remote.reaching(api):
        report = probes.run_with_api(
            results,
            label=label,
            folds=folds,
            api=api,
            source=source,
            group_by=group_by,
            api_key=api_key,
            turns=turns,
            versus=versus,
            retry_timeout=retry_timeout,
        )
    for probe in report["probes"]:
        score = (
            probe.get("skipped")
            or f"balanced accuracy {probe['balanced_accuracy_mean']:.3f} ± {probe['balanced_accuracy_std']:.3f}"
        )
        typer.echo(f"{probe['point']:<44} {probe['pooling']:<15} {score}")
    for note in report["notes"]:  # a pooling left out for some rows says so: nothing is substituted
        typer.echo(f"note: {note}", err=True)
    written = results if versus is None else probes.versus_dir(results, versus)
    directions = written / probes.DIRECTIONS_FILE
    also = f" and {directions} (each probe's direction, for --steer)" if directions.exists() else ""
    typer.echo(f"wrote {written / 'probes.json'}, {written / 'probes.png'}{also}")


@cli.command("export")
def export_command(
    results: Path | None = typer.Argument(
        None, help="A results directory from `actq run-file` or `actq gsm8k` (or `actq run`'s answers/)."
    ),
    jobs: list[str] | None = typer.Option(
        None,
        "--jobs",
        help="Instead of RESULTS, this API key's jobs that pass a GET /jobs filter: metadata.KEY=VALUE, "
        "user=NAME or created_after=ISO-TIME (repeat to AND them), oldest first.",
    ),
    label: str | None = typer.Option(
        None,
        "--label",
        help="Instead of RESULTS, this API key's jobs of one run: those sent to /runs/LABEL/v1 (the same as "
        "--jobs metadata.run=LABEL; combines with --jobs).",
    ),
    format: str = typer.Option("parquet", "--format", help="parquet (one file) or hf-dataset (datasets.save_to_disk)."),
    out: Path | None = typer.Option(
        None, help="Where to write (default: RESULTS/export.parquet or RESULTS/hf-dataset; with --jobs, here)."
    ),
    api: str | None = typer.Option(None, help="API base URL for activations not downloaded (default ACTQ_API_URL)."),
    api_key: str | None = API_KEY_OPTION,
    turns: str = typer.Option(
        "all", help="A tool run's turns (columns turn, tool_calls): all (a row per turn's job), first or last."
    ),
    retry_timeout: float = RETRY_OPTION,
) -> None:
    """A results directory of `actq run-file` (one row per prompt line) or `actq gsm8k` (one row per
    problem and capture source), or the jobs `--jobs` or `--label` picks (one row per job, with its created_at,
    user and metadata), a row per capture point: the tensor as an array, the prompt, token ids,
    positions and the sample's fields as columns; loadable with `datasets` or pandas, without actq
    installed."""
    from shared.cli import export
    from shared.listing import METADATA, RUN_KEY

    if label is not None:
        jobs = [*(jobs or []), f"{METADATA}{RUN_KEY}={label}"]
    written = export.run(
        results,
        format=format,
        out=out,
        api=api,
        api_key=api_key,
        jobs=jobs,
        turns=turns,
        retry_timeout=retry_timeout,
    )
    typer.echo(f"wrote {written}")


@cli.command("cancel")
def cancel_command(
    run: list[str] | None = typer.Option(
        None,
        "--run",
        help="A run label (repeatable): the jobs tagged metadata.run=LABEL, as `actq run-file` and `actq gsm8k` tag "
        "theirs (printed on Ctrl-C) and /runs/LABEL/v1 tags an OpenAI client's.",
    ),
    jobs: list[str] | None = typer.Option(
        None,
        "--jobs",
        help="Instead of --run, this API key's jobs that pass a GET /jobs filter: metadata.KEY=VALUE, user=NAME or "
        "created_after=ISO-TIME (repeat to AND them).",
    ),
    api: str | None = API_OPTION,
    api_key: str | None = API_KEY_OPTION,
    retry_timeout: float = RETRY_OPTION,
) -> None:
    """Cancel this API key's unfinished jobs of a run: each queued job ends `cancelled` at once, each
    running one within a decoding step (POST /jobs/{id}/cancel). Finished jobs are left as they are;
    says how many were cancelled and how many had already finished."""
    if bool(run) == bool(jobs):
        raise typer.BadParameter("give --run LABEL (repeatable) or --jobs filters, one of the two")
    with remote.reaching(api), remote.client(api, api_key, retry_seconds=retry_timeout) as client:
        for line in cancel.cancel_selected(client, run or [], jobs or []):
            typer.echo(line)


FLOWER_TASK_COLUMNS = "name,uuid,state,kwargs,exception,received,runtime,worker"


@cli.command("flower")
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


@cli.command("prepare-model")
def prepare_model() -> None:
    """Convert the built-in model into ACTQ_MODEL_CACHE_DIR now (the worker otherwise does it on first start)."""
    # The worker's own code does it, in a process of its own: the CLI never imports worker/.
    done = subprocess.run([sys.executable, "-m", "worker.models"], check=False)
    if done.returncode:
        raise typer.Exit(done.returncode)


@cli.command("env-example")
def env_example() -> None:
    """Print every setting with its default and meaning, in .env format (how .env.example is made)."""
    typer.echo(render_env_example(), nl=False)

"""The commands on a run's results and jobs: `actq probe` (linear probes), `actq export` (Parquet
or a Hugging Face dataset) and `actq cancel` (a run's unfinished jobs)."""

from __future__ import annotations

from pathlib import Path

import typer

from shared.cli import cancel, probes, remote
from shared.cli.bulk_commands import API_KEY_OPTION, API_OPTION, RETRY_OPTION


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
    format: str = typer.Option(
        "parquet",
        "--format",
        help="parquet (one file), hf-dataset (datasets.save_to_disk) or saelens (windows of tokens that SAELens reads "
        "as cached activations).",
    ),
    out: Path | None = typer.Option(
        None,
        help="Where to write (default: RESULTS/export.parquet, RESULTS/hf-dataset or RESULTS/saelens; "
        "with --jobs, here).",
    ),
    api: str | None = typer.Option(None, help="API base URL for activations not downloaded (default ACTQ_API_URL)."),
    api_key: str | None = API_KEY_OPTION,
    turns: str = typer.Option(
        "all", help="A tool run's turns (columns turn, tool_calls): all (a row per turn's job), first or last."
    ),
    retry_timeout: float = RETRY_OPTION,
    context_size: int = typer.Option(128, help="saelens: tokens per window (SAELens's context_size)."),
    tokens: str = typer.Option("all", help="saelens: the rows to pack: all, prompt or generated tokens."),
    module: list[str] | None = typer.Option(
        None, "--module", help="saelens: a captured point to export (repeat; default every point captured per token)."
    ),
) -> None:
    """A results directory of `actq run-file` (one row per prompt line) or `actq gsm8k` (one row per
    problem and capture source), or the jobs `--jobs` or `--label` picks (one row per job, with its created_at,
    user and metadata), a row per capture point: the tensor as an array, the prompt, token ids,
    positions and the sample's fields as columns; loadable with `datasets` or pandas, without actq
    installed. `--format saelens`: every token's captured rows packed into windows, a column per
    point plus token_ids and each row's job and position (docs/your-own-data.md)."""
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
        saelens={"context": context_size, "tokens": tokens, "modules": module or None},
    )
    typer.echo(f"wrote {written}")


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

"""`actq run`: the demo on one machine (Redis, a worker and the API started and stopped; GSM8K
answers captured, probes trained on traced solutions, the answers steered along the best probe)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from shared.cli import local_stack, probes, steer
from shared.cli.gsm8k import data, runner
from shared.settings import Settings


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

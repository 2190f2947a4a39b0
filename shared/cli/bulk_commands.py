"""The bulk commands, `actq run-file` and `actq gsm8k` (a dataset through the queue, resumable,
optionally once per steering strength), with the options they share and what Ctrl-C prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer

from shared.cli import cancel, remote, steer
from shared.cli.gsm8k import runner

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


def interrupted(exc: KeyboardInterrupt, what: str, out: Path) -> NoReturn:
    """Ctrl-C in a bulk run: what is kept, and the jobs it leaves on the queue with the command
    that cancels them (shared/cli/cancel.py); exit 130."""
    typer.echo(f"\ninterrupted: finished {what} are saved in {out}; run the same command to resume", err=True)
    if isinstance(exc, cancel.Interrupted):
        typer.echo(exc.report(), err=True)
    raise typer.Exit(130) from None


def steering_done(content: dict, out: Path) -> None:
    for row in content["strengths"]:
        shown = {k: row.get(k) for k in ("coeff", "n", "metric", "strict", "flexible", "edited_positions") if k in row}
        typer.echo(json.dumps(shown))
    typer.echo(f"wrote {out / 'steering.json'} and {out / 'steering.png'} ({content['metric']} by coeff)")


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
        interrupted(exc, "prompts", out)
    if steering is not None:
        steering_done(summary, out)
        return
    typer.echo(json.dumps({k: summary[k] for k in ("prompts", "finished", "succeeded", "failed")}))


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
        interrupted(exc, "problems", out)
    if steering is not None:
        steering_done(summary, out)
        return
    shown = ("problems", "finished", "succeeded", "failed", "accuracy")
    tools = summary.get("tools")
    extra = {k: tools[k] for k in ("turns_per_item_mean", "tool_calls_per_item_mean")} if tools else {}
    typer.echo(json.dumps({**{k: summary[k] for k in shown}, **extra}))

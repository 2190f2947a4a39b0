"""`actq gsm8k`: GSM8K's prompt styles, gold and corrupted traces and scoring, on the generic bulk
runner (shared/cli/batch.py: batch submission, live progress, resume without duplicates, the
results directory).

What is captured (`--capture-on`, comma-separated): `generated`, the model's own answer (a
generation job, as ever); `gold`, a trace job over the gold solution (the question as the user
turn, GSM8K's worked answer, calculator notes removed and ending "The answer is N.", as the
assistant turn); `corrupted`, a trace job over the same solution with a wrong final number. Trace
jobs capture the assistant turn (positions `completion` where the generation captures
`generated`) and score it (`logprob_total`, `completion_logprob`).

Results directory:
  run.json           the run's id and settings, the resolved prompt format among them (a resumed
                     run must use the same settings)
  jobs.json          "<index>" (generation) or "<index>:<source>" (trace) -> job id, written as
                     soon as jobs are queued
  samples/<n>.json   one per finished problem (all its jobs ended): question, gold, completion,
                     extracted answers, correctness, job id, usage, activations manifest (and the
                     local file with --download); `traces`: source -> the trace job's text,
                     answer, whether it is right, log-probabilities, activations
  activations/<n>.safetensors, activations/<n>.<source>.safetensors   with --download
  results.jsonl      every sample, in index order; summary.json: counts, accuracies, time, tokens/s

With tools (`--mode with-tools`, shared/cli/tool_loop.py): each problem is a conversation of up
to `--max-turns` jobs, the same prompt as without tools plus the calculator (`tools`, tool_choice
"auto"); the model's calls are answered by the calculator and fed back, and the turn without calls
is the answer, scored as ever. Each turn is a job with the run's capture (jobs.json
"<index>:turn<t>"); trajectories/<n>.jsonl records every turn; a sample's job fields are its last
turn's, `turn_jobs` lists every turn's job, `turns`, `tool_calls` and `ended` say how it went; and
summary.json adds `tools` (turns and tool calls per problem, their totals and means).

Resuming: problems with a sample are skipped; the others are submitted again with idempotency keys
derived from the run id, the problem index and the source, so a job queued before an interruption
is returned, not duplicated, and followed to its end.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from shared.cli import batch, captures, remote, steer, tool_loop
from shared.cli.batch import Item
from shared.cli.gsm8k import data
from shared.cli.gsm8k.scoring import accuracy, flexible_match, is_correct, score
from shared.client import Client, Job
from shared.errors import ToolError


@dataclass
class RunSettings:
    model: str
    dataset: str
    split: str = "test"
    style: str = "zero-shot"
    max_tokens: int = 256
    temperature: float = 0.0
    capture: dict | None = None
    indices: list[int] = field(default_factory=list)
    # "chat" (messages) or "plain" (a raw prompt), resolved from --prompt-format. Runs written
    # before the field existed were all chat: their run.json lacks it and reads as "chat".
    prompt_format: str = "chat"
    # What is captured: "generated", "gold", "corrupted", comma-separated (SOURCES); runs from
    # before the field generated only.
    capture_on: str = "generated"
    # A steering sweep's edit (shared/cli/steer.py), on every job of the run; None: unsteered.
    interventions: list[dict] | None = None
    # "no-tools" (one job per problem, as runs from before the field) or "with-tools" (a
    # conversation with the calculator of up to max_turns jobs; max_turns None without tools).
    mode: str = "no-tools"
    max_turns: int | None = None
    # With tools: the first turn's tool_choice, "auto" or "required" (the model must call the
    # calculator first, by constrained decoding; later turns are "auto"). None without tools.
    tool_choice: str | None = None

    @property
    def sources(self) -> list[str]:
        return self.capture_on.split(",")

    @classmethod
    def defaults(cls) -> dict:
        """The fields with a plain default, filled into a saved run's settings that lack them."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


class Run(batch.BatchRun):
    """A GSM8K results directory: items are problems (samples/<index>.json), parts are sources."""

    def __init__(self, out: Path, settings: RunSettings, kind: str = "gsm8k") -> None:
        # a field added since the run was written takes its default (the behaviour of that time)
        super().__init__(out, kind, asdict(settings), main="generated", defaults=RunSettings.defaults())
        self.run_settings = settings

    def key(self, index: int, source: str = "generated") -> str:
        return self.idempotency_key(index, source)

    def record(self, problem: data.Problem, jobs: dict[str, Job], download: bool) -> dict:
        """Write the sample of a problem whose jobs (source -> job) have all ended."""
        sample: dict = {"index": problem.index, "question": problem.question, "gold": problem.gold}
        generated = jobs.get("generated")
        if generated is not None:
            result = batch.job_result(generated)
            completion = result.get("text", "")
            sample |= {
                "completion": completion,
                **score(completion, problem.gold),
                "job_id": generated.id,
                "status": generated.data["status"],
                "error": generated.data.get("error"),
                "finish_reason": result.get("finish_reason"),
                "prompt_tokens": (result.get("usage") or {}).get("prompt_tokens"),
                "completion_tokens": (result.get("usage") or {}).get("completion_tokens"),
                **self._activations(generated, f"{problem.index}.safetensors", download),
                **steer.interventions_of(generated),
            }
        else:  # a trace-only run: the problem succeeded when its traces did
            ok = all(job.data["status"] == "succeeded" for job in jobs.values())
            sample |= {"completion": None, "correct": None, "job_id": None, "completion_tokens": None}
            sample |= {"status": "succeeded" if ok else "failed", "activations": None, "activations_file": None}
        traces = {source: job for source, job in jobs.items() if source != "generated"}
        if traces:
            sample["traces"] = {
                source: self._trace(problem, source, job, download) for source, job in sorted(traces.items())
            }
        return sample

    def _activations(self, job: Job, filename: str, download: bool) -> dict:
        return self.download(job, filename, download)

    def _trace(self, problem: data.Problem, source: str, job: Job, download: bool) -> dict:
        result = job.data.get("result") or {}
        logprobs = result.get("logprobs") or {}
        text = data.trace_text(problem, source)
        answer = flexible_match(text)
        return {
            "job_id": job.id,
            "status": job.data["status"],
            "error": job.data.get("error"),
            "text": text,
            "answer": answer,
            "correct": is_correct(answer, problem.gold),
            "prompt_tokens": (result.get("usage") or {}).get("prompt_tokens"),
            "completion_span": result.get("completion_span"),
            "logprob_total": logprobs.get("total"),
            "completion_logprob": logprobs.get("completion_total"),
            **self._activations(job, f"{problem.index}.{source}.safetensors", download),
            **steer.interventions_of(job),
        }


MODES = ("no-tools", "with-tools")


def record_conversation(problem: data.Problem, turns: list[dict], max_turns: int) -> dict:
    """A with-tools problem's sample: the question, the last turn's answer scored as ever, and its
    conversation (tool_loop.sample_fields: turns, tool calls, every turn's job)."""
    fields = tool_loop.sample_fields(problem.index, turns, max_turns)
    completion = fields.pop("text")
    sample = {"index": problem.index, "question": problem.question, "gold": problem.gold, "completion": completion}
    return {**sample, **score(completion, problem.gold), **fields}


def conversations(s: RunSettings, problems: list[data.Problem], exemplars: list[data.Exemplar] | None) -> list:
    """A with-tools run's conversations: the prompt of a run without tools, the calculator as the
    one tool (the first turn's tool_choice --tool-choice, one call when required), the run's
    sampling and capture at every turn."""
    forced = s.tool_choice == "required"
    request = {
        "model": s.model,
        "tools": tool_loop.calculator_tools(),
        "tool_choice": s.tool_choice or "auto",
        **({"parallel_tool_calls": False} if forced else {}),
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "capture": s.capture,
    }
    return [
        tool_loop.Conversation(key=p.index, messages=data.messages(p, s.style, exemplars), request=request, data=p)
        for p in problems
    ]


def execute_with_tools(
    client: Client,
    run: Run,
    problems: list[data.Problem],
    exemplars: list[data.Exemplar] | None,
    download: bool,
    quiet: bool = False,
) -> dict:
    """Every problem's conversation with the calculator to its end, scored; summary.json adds the
    tool figures (turns and tool calls per problem)."""
    max_turns = run.run_settings.max_turns or tool_loop.MAX_TURNS_DEFAULT
    return tool_loop.execute(
        client,
        run,
        conversations(run.run_settings, problems, exemplars),
        lambda c, turns, _last: record_conversation(c.data, turns, max_turns),
        max_turns=max_turns,
        item_name="problem",
        download=download,
        unit="problem",
        summarize_more=summarize,
        quiet=quiet,
    )


def summarize(samples: list[dict]) -> dict:
    scored = accuracy(s for s in samples if s["status"] == "succeeded" and s.get("correct"))
    return {"accuracy": {"strict": scored["strict"], "flexible": scored["flexible"]}}


def plan(
    run: Run, problems: list[data.Problem], exemplars: list[data.Exemplar] | None, download: bool
) -> batch.Planned:
    """The run's items (a problem each, a job per source) and how each is recorded."""
    s = run.run_settings
    items = [
        Item(key=p.index, requests={source: job_request(s, p, source, exemplars) for source in s.sources}, data=p)
        for p in problems
    ]
    return batch.Planned(run, items, lambda item, jobs: run.record(item.data, jobs, download), summarize)


def execute(
    client: Client,
    run: Run,
    problems: list[data.Problem],
    exemplars: list[data.Exemplar] | None,
    download: bool,
    quiet: bool = False,
) -> dict:
    """Submit what is not finished, follow it to the end, score it and write the results."""
    return batch.execute_many(client, [plan(run, problems, exemplars, download)], unit="problem", quiet=quiet)[0]


def job_key(index: int, source: str) -> str:
    """A job's key in jobs.json: the index for the generation, "<index>:<source>" for a trace."""
    return str(index) if source == "generated" else f"{index}:{source}"


def job_request(
    s: RunSettings, problem: data.Problem, source: str, exemplars: list[data.Exemplar] | None
) -> dict[str, object]:
    """The job for one problem and source: its generation, or a trace over its gold (or
    corrupted) solution as the assistant's reply to the same prompt, scored and captured on that
    reply (positions "completion" where the generation captures "generated")."""
    edits = {"interventions": s.interventions} if s.interventions is not None else {}
    if source == "generated":
        return {
            "model": s.model,
            **data.request_fields(problem, s.style, s.prompt_format, exemplars),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "capture": s.capture,
            **edits,
        }
    turns = data.messages(problem, s.style, exemplars)
    turns.append({"role": "assistant", "content": data.trace_text(problem, source)})
    capture = None
    if s.capture is not None:
        positions = s.capture.get("positions", "all")
        capture = {**s.capture, "positions": "completion" if positions == "generated" else positions}
    return {"model": s.model, "mode": "trace", "messages": turns, "capture": capture, "logprobs": True, **edits}


def run(
    *,
    out: Path,
    dataset: str,
    split: str = "test",
    train: str | None = None,
    limit: int | None = None,
    offset: int = 0,
    sample: int | None = None,
    seed: int = 0,
    style: str = "zero-shot",
    prompt_format: str = "auto",
    model: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    module: list[str] | None = None,
    no_capture: bool = False,
    positions: str = "generated",
    dtype: str = "float16",
    layers: str = "spread",
    reduce: str = "none",
    capture_on: str = "generated",
    download: bool = False,
    api: str | None = None,
    api_key: str | None = None,
    quiet: bool = False,
    steer_options: steer.Options | None = None,
    mode: str = "no-tools",
    max_turns: int = tool_loop.MAX_TURNS_DEFAULT,
    tool_choice: str = "auto",
    retry_timeout: float = remote.DEFAULT_SECONDS,
) -> dict:
    """`actq gsm8k`: load the problems, choose the prompt format and the capture, submit what is
    not done, follow it, score it. Ctrl-C (KeyboardInterrupt) leaves a consistent directory and is
    re-raised. With `steer_options`, the whole run once per strength (shared/cli/steer.py):
    returns steering.json's content. `mode` "with-tools": each problem a conversation with the
    calculator of up to `max_turns` jobs."""
    if mode not in MODES:
        raise ToolError(f"unknown --mode {mode!r}: no-tools or with-tools")
    if max_turns < 1:
        raise ToolError(f"--max-turns {max_turns}: give at least 1")
    if tool_choice not in ("auto", "required"):
        raise ToolError(f"unknown --tool-choice {tool_choice!r}: auto or required")
    tools = mode == "with-tools"
    if tool_choice == "required" and not tools:
        raise ToolError("--tool-choice required forces the first turn's calculator call: use it with --mode with-tools")
    if tools and capture_on != "generated":
        raise ToolError("--mode with-tools runs the model's own answers: leave --capture-on at generated")
    if tools and steer_options is not None:
        raise ToolError("--steer runs without tools: leave --mode at no-tools")
    if tools and prompt_format == "plain":
        raise ToolError(
            "--mode with-tools needs a chat (tools are rendered by the chat template): use --prompt-format chat or auto"
        )
    if style not in data.STYLES:
        raise ToolError(f"unknown --style {style!r}: zero-shot, cot-8shot or bare")
    if prompt_format not in data.PROMPT_FORMATS:
        raise ToolError(f"unknown --prompt-format {prompt_format!r}: auto, chat or plain")
    sources = data.capture_sources(capture_on)
    if steer_options is not None and "generated" not in sources:
        raise ToolError("--steer measures the accuracy of the generated answers: include generated in --capture-on")
    vector = steer.read_vector(steer_options) if steer_options is not None else None
    problems = data.select(data.load(dataset, split), offset=offset, limit=limit, sample=sample, seed=seed)
    exemplars = None
    if style == "cot-8shot":
        if train is None and dataset not in ("hub", "samples"):
            train = str(Path(dataset).expanduser().with_name("train.jsonl"))
        exemplars = data.fewshot_exemplars(data.load(train or dataset, "train"))
    with remote.reaching(api), remote.client(api, api_key, retry_seconds=retry_timeout) as client:
        model, info = captures.choose_model(client, model)
        resolved_format = data.resolve_prompt_format(prompt_format, model, info)
        if resolved_format == "plain" and sources != ["generated"]:
            raise ToolError(
                "--capture-on gold/corrupted traces the solution as the assistant's turn of a chat, and this run "
                "uses plain prompts (a model without a chat template); capture on generated only"
            )
        capture = captures.choose_capture(model, info, module, no_capture, positions, dtype, layers, reduce)
        settings = RunSettings(
            model=model,
            dataset=dataset,
            split=split,
            style=style,
            max_tokens=max_tokens,
            temperature=temperature,
            capture=capture,
            indices=[p.index for p in problems],
            prompt_format=resolved_format,
            capture_on=",".join(sources),
            mode=mode,
            max_turns=max_turns if tools else None,
            tool_choice=tool_choice if tools else None,
        )
        if tools:
            if resolved_format != "chat":
                raise ToolError(
                    f"model {model!r} has no chat template, so it cannot be given tools: use --mode no-tools"
                )
            return execute_with_tools(client, Run(Path(out), settings), problems, exemplars, download, quiet=quiet)
        if steer_options is None or vector is None:
            return execute(client, Run(Path(out), settings), problems, exemplars, download=download, quiet=quiet)

        def planned(directory: Path, interventions: list[dict] | None, label: str) -> batch.Planned:
            steered = replace(settings, interventions=interventions)
            return plan(Run(directory, steered, kind=f"gsm8k-coeff={label}"), problems, exemplars, download)

        swept, summaries = steer.sweep(client, Path(out), steer_options, vector, planned, unit="problem", quiet=quiet)
        return steer.report(swept, summaries, steer.gsm8k_metric, "accuracy_flexible", model)

"""`actq gsm8k`: submit a GSM8K run in bulk, follow it with a live progress bar, score it, and keep
a results directory that a second invocation resumes.

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

Resuming: problems with a sample are skipped; the others are submitted again with idempotency keys
derived from the run id, the problem index and the source, so a job queued before an interruption
is returned, not duplicated, and followed to its end.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

from shared.cli.gsm8k import data
from shared.cli.gsm8k.scoring import accuracy, flexible_match, is_correct, score
from shared.client import Client, Job
from shared.errors import ToolError
from shared.settings import Settings

# Unfinished jobs the progress loop looks at behind the oldest one: twice the default
# ACTQ_MAX_BATCH, so the running count covers a full batch (one GET each per pass of the loop).
LOOKAHEAD = 32


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

    @property
    def sources(self) -> list[str]:
        return self.capture_on.split(",")

    @classmethod
    def defaults(cls) -> dict:
        """The fields with a plain default, filled into a saved run's settings that lack them."""
        return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def write_json(path: Path, data: object) -> None:
    """Whole or not at all: a temp file in the same directory, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


class Run:
    def __init__(self, out: Path, settings: RunSettings) -> None:
        self.out = out
        self.settings = settings
        self.samples = out / "samples"
        state_file = out / "run.json"
        if state_file.exists():
            state = json.loads(state_file.read_text())
            # a field added since the run was written takes its default (the behaviour of that time)
            saved, current = {**RunSettings.defaults(), **state["settings"]}, asdict(settings)
            if saved != current:
                changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
                raise ToolError(
                    f"{out} holds a run with other settings ({', '.join(changed)}); "
                    "use another --out to start a new run"
                )
            self.run_id = state["run_id"]
        else:
            self.run_id = uuid.uuid4().hex
            write_json(state_file, {"run_id": self.run_id, "settings": asdict(settings)})
        jobs_file = out / "jobs.json"
        # "<index>" (generation) or "<index>:<source>" (trace) -> job id
        self.jobs: dict[str, str] = json.loads(jobs_file.read_text()) if jobs_file.exists() else {}

    def key(self, index: int, source: str = "generated") -> str:
        return f"actq-gsm8k:{self.run_id}:{index}" + ("" if source == "generated" else f":{source}")

    def done(self) -> set[int]:
        return {int(p.stem) for p in self.samples.glob("*.json")} if self.samples.exists() else set()

    def record(self, problem: data.Problem, jobs: dict[str, Job], download: bool) -> dict:
        """Write the sample of a problem whose jobs (source -> job) have all ended."""
        sample: dict = {"index": problem.index, "question": problem.question, "gold": problem.gold}
        generated = jobs.get("generated")
        if generated is not None:
            result = generated.data.get("result") or {}
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
        write_json(self.samples / f"{problem.index}.json", sample)
        return sample

    def _activations(self, job: Job, filename: str, download: bool) -> dict:
        entry = {"activations": job.data.get("activations"), "activations_file": None}
        if download and entry["activations"]:
            target = self.out / "activations" / filename
            job.download(target)
            entry["activations_file"] = str(target.relative_to(self.out))
        return entry

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
        }

    def finish(self, wall: float, complete: bool) -> dict:
        samples = (
            [json.loads(p.read_text()) for p in sorted(self.samples.glob("*.json"), key=lambda p: int(p.stem))]
            if self.samples.exists()
            else []
        )
        with open(self.out / "results.jsonl", "w") as handle:
            for sample in samples:
                handle.write(json.dumps(sample) + "\n")
        scored = accuracy(s for s in samples if s["status"] == "succeeded" and s.get("correct"))
        tokens = sum(s["completion_tokens"] or 0 for s in samples)
        summary = {
            "run_id": self.run_id,
            "model": self.settings.model,
            "settings": asdict(self.settings),
            "complete": complete,
            "problems": len(self.settings.indices),
            "finished": len(samples),
            "succeeded": sum(s["status"] == "succeeded" for s in samples),
            "failed": sum(s["status"] != "succeeded" for s in samples),
            "accuracy": {"strict": scored["strict"], "flexible": scored["flexible"]},
            "wall_seconds_this_invocation": round(wall, 3),
            "generated_tokens": tokens,
            "tokens_per_second_this_invocation": round(tokens / wall, 3) if wall > 0 else None,
        }
        write_json(self.out / "summary.json", summary)
        return summary


def execute(
    client: Client,
    run: Run,
    problems: list[data.Problem],
    exemplars: list[data.Exemplar] | None,
    download: bool,
    quiet: bool = False,
) -> dict:
    """Submit what is not finished, follow it to the end, and write the results. Ctrl-C leaves a
    consistent directory (every finished problem has its sample) and is re-raised.

    Ctrl-C only sets a flag, read between requests: a KeyboardInterrupt raised in the middle of
    an HTTP call can leave the client's connection pool locked, and closing it then hangs (seen
    once in sixty seconds of waiting). Long polls are short (2 s) so that the flag is read soon."""
    with _interrupt_flag() as interrupted:
        return _execute(client, run, problems, exemplars, download, quiet, interrupted)


@contextmanager
def _interrupt_flag() -> Iterator[threading.Event]:
    """An event set by SIGINT while the block runs (in the main thread; elsewhere never set)."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _execute(
    client: Client,
    run: Run,
    problems: list[data.Problem],
    exemplars: list[data.Exemplar] | None,
    download: bool,
    quiet: bool,
    interrupted: threading.Event,
) -> dict:
    started = time.monotonic()
    s = run.settings
    todo = [p for p in problems if p.index not in run.done()]
    bar = tqdm(
        total=len(problems), initial=len(problems) - len(todo), unit="problem", disable=quiet, dynamic_ncols=True
    )
    counts = {"submitted": 0, "queued": 0, "running": 0, "succeeded": 0, "failed": 0}
    units = [(p, source) for p in todo for source in s.sources]  # one job each
    try:
        requests = [job_request(s, p, source, exemplars) for p, source in units]
        jobs: list[Job] = []
        for start in range(0, len(units), 500):
            chunk = units[start : start + 500]
            jobs += client.submit_many(
                requests[start : start + 500], idempotency_keys=[run.key(p.index, source) for p, source in chunk]
            )
            run.jobs.update(
                {job_key(p.index, source): j.id for (p, source), j in zip(chunk, jobs[start:], strict=True)}
            )
            write_json(run.out / "jobs.json", dict(sorted(run.jobs.items())))
            counts["submitted"] = len(jobs)
            if interrupted.is_set():
                raise KeyboardInterrupt
        pending = [(p, source, job) for (p, source), job in zip(units, jobs, strict=True)]
        ended: dict[int, dict[str, Job]] = {}  # problem index -> its ended jobs, until all have
        while pending:
            if interrupted.is_set():
                raise KeyboardInterrupt
            # Jobs finish roughly in queue order: long-poll the oldest, then look at the ones
            # behind it until LOOKAHEAD unfinished ones are seen (a worker runs a batch of jobs
            # at once, and they end out of order within it).
            head = pending[0][2].refresh(wait=2)
            finished: list[tuple[data.Problem, str, Job]] = []
            unfinished: list[Job] = []
            for problem, source, job in pending:
                if len(unfinished) >= LOOKAHEAD:
                    break
                if job is not head:
                    job.refresh()
                if job.done:
                    finished.append((problem, source, job))
                else:
                    unfinished.append(job)
            for problem, source, job in finished:
                ended.setdefault(problem.index, {})[source] = job
                if len(ended[problem.index]) == len(s.sources):
                    sample = run.record(problem, ended.pop(problem.index), download)
                    counts["succeeded" if sample["status"] == "succeeded" else "failed"] += 1
                    bar.update(1)
            done_ids = {job.id for _, _, job in finished}
            pending = [(p, source, j) for p, source, j in pending if j.id not in done_ids]
            counts["running"] = sum(1 for job in unfinished if job.status == "running")
            counts["queued"] = len(pending) - counts["running"]
            bar.set_postfix(counts, refresh=True)
    except KeyboardInterrupt:
        bar.close()
        run.finish(time.monotonic() - started, complete=False)
        raise
    bar.close()
    return run.finish(time.monotonic() - started, complete=True)


def job_key(index: int, source: str) -> str:
    """A job's key in jobs.json: the index for the generation, "<index>:<source>" for a trace."""
    return str(index) if source == "generated" else f"{index}:{source}"


def job_request(
    s: RunSettings, problem: data.Problem, source: str, exemplars: list[data.Exemplar] | None
) -> dict[str, object]:
    """The job for one problem and source: its generation, or a trace over its gold (or
    corrupted) solution as the assistant's reply to the same prompt, scored and captured on that
    reply (positions "completion" where the generation captures "generated")."""
    if source == "generated":
        return {
            "model": s.model,
            **data.request_fields(problem, s.style, s.prompt_format, exemplars),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "capture": s.capture,
        }
    turns = data.messages(problem, s.style, exemplars)
    turns.append({"role": "assistant", "content": data.trace_text(problem, source)})
    capture = None
    if s.capture is not None:
        positions = s.capture.get("positions", "all")
        capture = {**s.capture, "positions": "completion" if positions == "generated" else positions}
    return {"model": s.model, "mode": "trace", "messages": turns, "capture": capture, "logprobs": True}


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
    quiet: bool = False,
) -> dict:
    """`actq gsm8k`: load the problems, choose the prompt format and the capture, submit what is
    not done, follow it, score it. Ctrl-C (KeyboardInterrupt) leaves a consistent directory and is
    re-raised."""
    if style not in data.STYLES:
        raise ToolError(f"unknown --style {style!r}: zero-shot or cot-8shot")
    if prompt_format not in data.PROMPT_FORMATS:
        raise ToolError(f"unknown --prompt-format {prompt_format!r}: auto, chat or plain")
    sources = data.capture_sources(capture_on)
    problems = data.select(data.load(dataset, split), offset=offset, limit=limit, sample=sample, seed=seed)
    exemplars = None
    if style == "cot-8shot":
        if train is None and dataset not in ("hub", "samples"):
            train = str(Path(dataset).expanduser().with_name("train.jsonl"))
        exemplars = data.fewshot_exemplars(data.load(train or dataset, "train"))
    with Client(api or Settings().api_url, timeout=60) as client:
        served = client.models()
        if model is None:
            if len(served) != 1:
                raise ToolError(f"name a --model; live models: {', '.join(m['name'] for m in served) or 'none'}")
            model = served[0]["name"]
        info = next((m for m in served if m["name"] == model), None)
        if info is None:  # no live worker now; a model served before is still known (its jobs queue)
            info = next((m for m in client.models(include_offline=True) if m["name"] == model), None)
        resolved_format = data.resolve_prompt_format(prompt_format, model, info)
        if resolved_format == "plain" and sources != ["generated"]:
            raise ToolError(
                "--capture-on gold/corrupted traces the solution as the assistant's turn of a chat, and this run "
                "uses plain prompts (a model without a chat template); capture on generated only"
            )
        capture = None
        if not no_capture:
            if module:
                capture = {"modules": list(module), "hook": "output", "positions": positions, "dtype": dtype}
            elif info is not None:
                capture = data.residual_capture(info, positions=positions, dtype=dtype, layers=layers)
            else:
                raise ToolError(
                    f"no worker has published model {model!r}, so its residual preset is unknown; give --module"
                )
            if reduce != "none":
                capture["reduce"] = reduce
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
        )
        return execute(client, Run(Path(out), settings), problems, exemplars, download=download, quiet=quiet)

"""`actq gsm8k`: submit a GSM8K run in bulk, follow it with a live progress bar, score it, and keep
a results directory that a second invocation resumes.

Results directory:
  run.json           the run's id and settings, the resolved prompt format among them (a resumed
                     run must use the same settings)
  jobs.json          problem index -> job id, written as soon as jobs are queued
  samples/<n>.json   one per finished problem: question, gold, completion, extracted answers,
                     correctness, job id, usage, activations manifest (and the local file with --download)
  activations/<n>.safetensors   with --download
  results.jsonl      every sample, in index order; summary.json: counts, accuracies, time, tokens/s

Resuming: problems with a sample are skipped; the others are submitted again with idempotency keys
derived from the run id and the problem index, so a job queued before an interruption is returned,
not duplicated, and followed to its end.
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
from shared.cli.gsm8k.scoring import accuracy, score
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
        self.jobs: dict[int, str] = (
            {int(k): v for k, v in json.loads(jobs_file.read_text()).items()} if jobs_file.exists() else {}
        )

    def key(self, index: int) -> str:
        return f"actq-gsm8k:{self.run_id}:{index}"

    def done(self) -> set[int]:
        return {int(p.stem) for p in self.samples.glob("*.json")} if self.samples.exists() else set()

    def record(self, problem: data.Problem, job: Job, download: bool) -> dict:
        data = job.data
        result = data.get("result") or {}
        completion = result.get("text", "")
        sample = {
            "index": problem.index,
            "question": problem.question,
            "gold": problem.gold,
            "completion": completion,
            **score(completion, problem.gold),
            "job_id": job.id,
            "status": data["status"],
            "error": data.get("error"),
            "finish_reason": result.get("finish_reason"),
            "prompt_tokens": (result.get("usage") or {}).get("prompt_tokens"),
            "completion_tokens": (result.get("usage") or {}).get("completion_tokens"),
            "activations": data.get("activations"),
            "activations_file": None,
        }
        if download and data.get("activations"):
            target = self.out / "activations" / f"{problem.index}.safetensors"
            job.download(target)
            sample["activations_file"] = str(target.relative_to(self.out))
        write_json(self.samples / f"{problem.index}.json", sample)
        return sample

    def finish(self, wall: float, complete: bool) -> dict:
        samples = (
            [json.loads(p.read_text()) for p in sorted(self.samples.glob("*.json"), key=lambda p: int(p.stem))]
            if self.samples.exists()
            else []
        )
        with open(self.out / "results.jsonl", "w") as handle:
            for sample in samples:
                handle.write(json.dumps(sample) + "\n")
        scored = accuracy(s for s in samples if s["status"] == "succeeded")
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
    try:
        requests = [
            {
                "model": s.model,
                **data.request_fields(p, s.style, s.prompt_format, exemplars),
                "max_tokens": s.max_tokens,
                "temperature": s.temperature,
                "capture": s.capture,
            }
            for p in todo
        ]
        jobs: list[Job] = []
        for start in range(0, len(todo), 500):
            chunk = todo[start : start + 500]
            jobs += client.submit_many(
                requests[start : start + 500], idempotency_keys=[run.key(p.index) for p in chunk]
            )
            run.jobs.update({p.index: j.id for p, j in zip(chunk, jobs[start:], strict=True)})
            write_json(run.out / "jobs.json", {str(k): v for k, v in sorted(run.jobs.items())})
            counts["submitted"] = len(jobs)
            if interrupted.is_set():
                raise KeyboardInterrupt
        pending = list(zip(todo, jobs, strict=True))
        while pending:
            if interrupted.is_set():
                raise KeyboardInterrupt
            # Jobs finish roughly in queue order: long-poll the oldest, then look at the ones
            # behind it until LOOKAHEAD unfinished ones are seen (a worker runs a batch of jobs
            # at once, and they end out of order within it).
            head = pending[0][1].refresh(wait=2)
            finished: list[tuple[data.Problem, Job]] = []
            unfinished: list[tuple[data.Problem, Job]] = []
            for problem, job in pending:
                if len(unfinished) >= LOOKAHEAD:
                    break
                if job is not head:
                    job.refresh()
                (finished if job.done else unfinished).append((problem, job))
            for problem, job in finished:
                sample = run.record(problem, job, download)
                counts["succeeded" if sample["status"] == "succeeded" else "failed"] += 1
                bar.update(1)
            done_ids = {job.id for _, job in finished}
            pending = [(p, j) for p, j in pending if j.id not in done_ids]
            counts["running"] = sum(1 for _, job in unfinished if job.status == "running")
            counts["queued"] = len(pending) - counts["running"]
            bar.set_postfix(counts, refresh=True)
    except KeyboardInterrupt:
        bar.close()
        run.finish(time.monotonic() - started, complete=False)
        raise
    bar.close()
    return run.finish(time.monotonic() - started, complete=True)


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
        capture = None
        if not no_capture:
            if module:
                capture = {"modules": list(module), "hook": "output", "positions": positions, "dtype": dtype}
            elif info is not None:
                capture = data.residual_capture(info, positions=positions, dtype=dtype)
            else:
                raise ToolError(
                    f"no worker has published model {model!r}, so its residual preset is unknown; give --module"
                )
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
        )
        return execute(client, Run(Path(out), settings), problems, exemplars, download=download, quiet=quiet)

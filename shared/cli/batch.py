"""Bulk runs through the queue, whatever the data: `actq run-file` and `actq gsm8k` are layers on it.

A run is a list of items (a prompt file's lines, GSM8K problems), each with one or more jobs
(parts: a generation, trace jobs). The runner submits every job of every unfinished item in
batches of 500 with idempotency keys derived from the run id, the item and the part, follows them
with a progress bar, and writes a sample per item once all its jobs have ended.

Results directory:
  run.json           the run's id and settings (a resumed run must use the same settings)
  jobs.json          "<item>" (the main part) or "<item>:<part>" -> job id, written as soon as
                     jobs are queued
  samples/<item>.json  one per finished item, written whole (temp file + rename)
  activations/...    with --download
  results.jsonl      every sample, in item order; summary.json: counts, time, tokens/s

Nothing is written before the API has accepted the first jobs: a new run's directory (run.json
first) is created once the first batch is queued, so a request the API refuses (a typo'd module,
a layer the model lacks) leaves no --out behind, and the corrected command starts afresh.

Resuming: items with a sample are skipped; the others are submitted again with the same
idempotency keys, so a job queued before an interruption is returned, not duplicated, and
followed to its end. Ctrl-C only sets a flag read between requests and leaves a consistent
directory (every finished item has its sample).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

from shared.client import Client, Job
from shared.errors import ToolError

# Unfinished jobs the progress loop looks at behind the oldest one: twice the default
# ACTQ_MAX_BATCH, so the running count covers a full batch (one GET each per pass of the loop).
LOOKAHEAD = 32
SUBMIT_CHUNK = 500


def write_json(path: Path, data: object) -> None:
    """Whole or not at all: a temp file in the same directory, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, allow_nan=False)
    os.replace(tmp, path)


@dataclass
class Item:
    """One unit of a run: `key` names its sample file (samples/<key>.json: a number, never user
    text); `requests` maps each part to its job's request body; `data` is the layer's own."""

    key: int
    requests: dict[str, dict[str, Any]]
    data: Any = None


class BatchRun:
    """A results directory: its run id and settings, the jobs submitted, the samples written."""

    def __init__(
        self,
        out: Path,
        kind: str,
        settings: Mapping[str, Any],
        main: str,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """`kind` names the runner in idempotency keys; `main` is the part whose jobs.json key is
        the bare item key; `defaults` fill a saved run's settings written before a field existed."""
        self.out, self.kind, self.main, self.settings = out, kind, main, dict(settings)
        self.samples = out / "samples"
        state_file = out / "run.json"
        if state_file.exists():
            state = json.loads(state_file.read_text())
            saved, current = {**(defaults or {}), **state["settings"]}, self.settings
            if saved != current:
                changed = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
                raise ToolError(
                    f"{out} holds a run with other settings ({', '.join(changed)}); "
                    "use another --out to start a new run"
                )
            self.run_id = state["run_id"]
            self.saved = True
        else:  # written by save(), once the API has accepted the first jobs
            self.run_id = uuid.uuid4().hex
            self.saved = False
        jobs_file = out / "jobs.json"
        self.jobs: dict[str, str] = json.loads(jobs_file.read_text()) if jobs_file.exists() else {}

    def save(self) -> None:
        """Create the directory with its run.json (the run id, so that a resumed run finds its jobs
        again by their idempotency keys); nothing when it exists."""
        if not self.saved:
            write_json(self.out / "run.json", {"run_id": self.run_id, "settings": self.settings})
            self.saved = True

    def job_key(self, key: int, part: str) -> str:
        return str(key) if part == self.main else f"{key}:{part}"

    def idempotency_key(self, key: int, part: str) -> str:
        return f"actq-{self.kind}:{self.run_id}:{self.job_key(key, part)}"

    def done(self) -> set[int]:
        return {int(p.stem) for p in self.samples.glob("*.json")} if self.samples.exists() else set()

    def write_sample(self, key: int, sample: dict) -> None:
        write_json(self.samples / f"{key}.json", sample)

    def download(self, job: Job, filename: str, download: bool) -> dict:
        """The sample's `activations` (the manifest) and `activations_file` (with --download)."""
        entry = {"activations": job.data.get("activations"), "activations_file": None}
        if download and entry["activations"]:
            target = self.out / "activations" / filename
            job.download(target)
            entry["activations_file"] = str(target.relative_to(self.out))
        return entry

    def read_samples(self) -> list[dict]:
        if not self.samples.exists():
            return []
        return [json.loads(p.read_text()) for p in sorted(self.samples.glob("*.json"), key=lambda p: int(p.stem))]

    def finish(self, wall: float, complete: bool, total: int, unit: str, extra: Callable[[list[dict]], dict]) -> dict:
        """results.jsonl and summary.json from every sample written so far."""
        self.save()
        samples = self.read_samples()
        with open(self.out / "results.jsonl", "w") as handle:
            for sample in samples:
                handle.write(json.dumps(sample, allow_nan=False) + "\n")
        tokens = sum(s.get("completion_tokens") or 0 for s in samples)
        summary = {
            "run_id": self.run_id,
            "model": self.settings.get("model"),
            "settings": self.settings,
            "complete": complete,
            f"{unit}s": total,
            "finished": len(samples),
            "succeeded": sum(s["status"] == "succeeded" for s in samples),
            "failed": sum(s["status"] != "succeeded" for s in samples),
            **extra(samples),
            "wall_seconds_this_invocation": round(wall, 3),
            "generated_tokens": tokens,
            "tokens_per_second_this_invocation": round(tokens / wall, 3) if wall > 0 else None,
        }
        write_json(self.out / "summary.json", summary)
        return summary


def job_result(job: Job) -> dict[str, Any]:
    """A finished job's result as a sample records it: the record's copy, or the whole result
    (`GET /jobs/{id}/result`) when the API kept a long one apart and cut the record's text to its
    first characters (`stored.text_truncated`). {} when there is none."""
    result = job.data.get("result") or {}
    if (result.get("stored") or {}).get("text_truncated"):
        return job.result_data()
    return result


Record = Callable[[Item, dict[str, Job]], dict]


def execute(
    client: Client,
    run: BatchRun,
    items: list[Item],
    record: Record,
    *,
    unit: str = "item",
    summarize: Callable[[list[dict]], dict] = lambda _: {},
    quiet: bool = False,
) -> dict:
    """Submit the jobs of the items without a sample, follow them to the end, `record` each item
    once all its jobs ended (it returns the sample, with a `status`), and write the results.
    Ctrl-C leaves a consistent directory and is re-raised as KeyboardInterrupt.

    Ctrl-C only sets a flag, read between requests: a KeyboardInterrupt raised in the middle of
    an HTTP call can leave the client's connection pool locked, and closing it then hangs (seen
    once in sixty seconds of waiting). Long polls are short (2 s) so that the flag is read soon."""
    with _interrupt_flag() as interrupted:
        started = time.monotonic()
        try:
            _follow(client, run, items, record, unit, quiet, interrupted)
        except KeyboardInterrupt:
            if run.saved:  # interrupted before any job was queued: nothing to keep
                run.finish(time.monotonic() - started, False, len(items), unit, summarize)
            raise
        return run.finish(time.monotonic() - started, True, len(items), unit, summarize)


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


def _follow(
    client: Client,
    run: BatchRun,
    items: list[Item],
    record: Record,
    unit: str,
    quiet: bool,
    interrupted: threading.Event,
) -> None:
    done = run.done()
    todo = [item for item in items if item.key not in done]
    bar = tqdm(total=len(items), initial=len(items) - len(todo), unit=unit, disable=quiet, dynamic_ncols=True)
    counts = {"submitted": 0, "queued": 0, "running": 0, "succeeded": 0, "failed": 0}
    units = [(item, part) for item in todo for part in item.requests]  # one job each
    try:
        jobs: list[Job] = []
        for start in range(0, len(units), SUBMIT_CHUNK):
            chunk = units[start : start + SUBMIT_CHUNK]
            jobs += client.submit_many(
                [item.requests[part] for item, part in chunk],
                idempotency_keys=[run.idempotency_key(item.key, part) for item, part in chunk],
            )
            run.save()  # the API accepted them: from now on the run is resumable
            run.jobs.update(
                {run.job_key(item.key, part): j.id for (item, part), j in zip(chunk, jobs[start:], strict=True)}
            )
            write_json(run.out / "jobs.json", dict(sorted(run.jobs.items())))
            counts["submitted"] = len(jobs)
            if interrupted.is_set():
                raise KeyboardInterrupt
        pending = [(item, part, job) for (item, part), job in zip(units, jobs, strict=True)]
        ended: dict[int, dict[str, Job]] = {}  # item key -> its ended jobs, until all have
        while pending:
            if interrupted.is_set():
                raise KeyboardInterrupt
            # Jobs finish roughly in queue order: long-poll the oldest, then look at the ones
            # behind it until LOOKAHEAD unfinished ones are seen (a worker runs a batch of jobs
            # at once, and they end out of order within it).
            head = pending[0][2].refresh(wait=2)
            finished: list[tuple[Item, str, Job]] = []
            unfinished: list[Job] = []
            for item, part, job in pending:
                if len(unfinished) >= LOOKAHEAD:
                    break
                if job is not head:
                    job.refresh()
                if job.done:
                    finished.append((item, part, job))
                else:
                    unfinished.append(job)
            for item, part, job in finished:
                ended.setdefault(item.key, {})[part] = job
                if len(ended[item.key]) == len(item.requests):
                    sample = record(item, ended.pop(item.key))
                    run.write_sample(item.key, sample)
                    counts["succeeded" if sample["status"] == "succeeded" else "failed"] += 1
                    bar.update(1)
            done_ids = {job.id for _, _, job in finished}
            pending = [(i, p, j) for i, p, j in pending if j.id not in done_ids]
            counts["running"] = sum(1 for job in unfinished if job.status == "running")
            counts["queued"] = len(pending) - counts["running"]
            bar.set_postfix(counts, refresh=True)
    finally:
        bar.close()

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
directory (every finished item has its sample); the jobs still on the queue are counted and
the command that cancels them is given (shared/cli/cancel.py: every job carries the run's label
as `metadata.run`).
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

from shared.cli import cancel
from shared.client import Client, Job
from shared.errors import ToolError
from shared.listing import RUN_KEY

# Unfinished jobs the progress loop looks at behind the oldest one: twice the default
# ACTQ_MAX_BATCH, so the running count covers a full batch (one GET each per pass of the loop).
LOOKAHEAD = 32
SUBMIT_CHUNK = 500


def write_json(path: Path, data: object) -> None:
    """Whole or not at all: a temp file in the same directory, then a rename."""
    write_text(path, json.dumps(data, indent=2, allow_nan=False))


def write_text(path: Path, text: str) -> None:
    """Whole or not at all: a temp file in the same directory, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
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
        self.on_save: Callable[[], None] | None = None  # called once when save() creates the directory
        jobs_file = out / "jobs.json"
        self.jobs: dict[str, str] = json.loads(jobs_file.read_text()) if jobs_file.exists() else {}

    @property
    def label(self) -> str:
        """The run label its jobs carry as `metadata.run` (`actq cancel --run`, `actq export --label`)."""
        return cancel.run_label(self.kind, self.run_id)

    def tagged(self, request: dict[str, Any]) -> dict[str, Any]:
        """A job's request with the run label added to its metadata."""
        return {**request, "metadata": {**(request.get("metadata") or {}), RUN_KEY: self.label}}

    def save(self) -> None:
        """Create the directory with its run.json (the run id, so that a resumed run finds its jobs
        again by their idempotency keys); nothing when it exists."""
        if not self.saved:
            if self.on_save is not None:
                self.on_save()
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
        # a tool run's sample counts every turn's tokens in `generated_tokens` (shared/cli/tool_loop.py)
        tokens = sum(s.get("generated_tokens", s.get("completion_tokens")) or 0 for s in samples)
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
Summarize = Callable[[list[dict]], dict]


@dataclass
class Planned:
    """One results directory of a multi-run pass (`execute_many`): its items, how to record each
    and what its summary adds."""

    run: BatchRun
    items: list[Item]
    record: Record
    summarize: Summarize = lambda _: {}


def execute(
    client: Client,
    run: BatchRun,
    items: list[Item],
    record: Record,
    *,
    unit: str = "item",
    summarize: Summarize = lambda _: {},
    quiet: bool = False,
) -> dict:
    """Submit the jobs of the items without a sample, follow them to the end, `record` each item
    once all its jobs ended (it returns the sample, with a `status`), and write the results.
    Ctrl-C leaves a consistent directory and is re-raised as KeyboardInterrupt."""
    return execute_many(client, [Planned(run, items, record, summarize)], unit=unit, quiet=quiet)[0]


def execute_many(client: Client, plans: list[Planned], *, unit: str = "item", quiet: bool = False) -> list[dict]:
    """`execute` for several results directories in one pass through the queue (a steering sweep:
    one directory per strength): their jobs are submitted together, item by item across the
    directories (item 0 of each, then item 1...), so that the worker batches them together, and
    each directory gets its samples and summary. Returns the summaries in the plans' order.

    Ctrl-C only sets a flag, read between requests (and ending a retry's wait): a
    KeyboardInterrupt raised in the middle of an HTTP call can leave the client's connection pool
    locked, and closing it then hangs (seen once in sixty seconds of waiting). Long polls are
    short (2 s) so that the flag is read soon. It is re-raised as `cancel.Interrupted`, which
    counts the jobs left on the queue and says how to cancel them."""
    with interrupt_flag() as interrupted, retries_interrupted(client, interrupted):
        started = time.monotonic()
        try:
            _follow(client, plans, unit, quiet, interrupted)
        except KeyboardInterrupt:
            for plan in plans:
                if plan.run.saved:  # interrupted before any of its jobs was queued: nothing to keep
                    plan.run.finish(time.monotonic() - started, False, len(plan.items), unit, plan.summarize)
            raise_interrupted(client, [plan.run for plan in plans])
        wall = time.monotonic() - started
        return [plan.run.finish(wall, True, len(plan.items), unit, plan.summarize) for plan in plans]


def raise_interrupted(client: Client, runs: list[BatchRun]) -> None:
    """Ctrl-C, once the runs' directories are consistent: `cancel.Interrupted` naming the runs
    that queued jobs and how many of them are left, or a plain KeyboardInterrupt when none did."""
    labels = [run.label for run in runs if run.saved]
    if not labels:
        raise KeyboardInterrupt
    raise cancel.interrupted(client, labels) from None


@contextmanager
def retries_interrupted(client: Client, interrupted: threading.Event) -> Iterator[None]:
    """The client's retry waits end at Ctrl-C while the block runs."""
    previous, client.interrupted = client.interrupted, interrupted
    try:
        yield
    finally:
        client.interrupted = previous


@contextmanager
def interrupt_flag() -> Iterator[threading.Event]:
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


def _follow(client: Client, plans: list[Planned], unit: str, quiet: bool, interrupted: threading.Event) -> None:
    todo: list[list[Item]] = []
    for plan in plans:
        done = plan.run.done()
        todo.append([item for item in plan.items if item.key not in done])
    total = sum(len(plan.items) for plan in plans)
    left = sum(len(items) for items in todo)
    bar = tqdm(total=total, initial=total - left, unit=unit, disable=quiet, dynamic_ncols=True)
    counts = {"submitted": 0, "queued": 0, "running": 0, "succeeded": 0, "failed": 0}
    # one job each: (plan index, item, part), item by item across the plans
    units = [
        (p, items[row], part)
        for row in range(max((len(items) for items in todo), default=0))
        for p, items in enumerate(todo)
        if row < len(items)
        for part in items[row].requests
    ]
    try:
        jobs: list[Job] = []
        for start in range(0, len(units), SUBMIT_CHUNK):
            chunk = units[start : start + SUBMIT_CHUNK]
            jobs += client.submit_many(
                [plans[p].run.tagged(item.requests[part]) for p, item, part in chunk],
                idempotency_keys=[plans[p].run.idempotency_key(item.key, part) for p, item, part in chunk],
            )
            for p in sorted({p for p, _, _ in chunk}):
                run = plans[p].run
                run.save()  # the API accepted them: from now on the run is resumable
                run.jobs.update(
                    {
                        run.job_key(item.key, part): j.id
                        for (q, item, part), j in zip(chunk, jobs[start:], strict=True)
                        if q == p
                    }
                )
                write_json(run.out / "jobs.json", dict(sorted(run.jobs.items())))
            counts["submitted"] = len(jobs)
            if interrupted.is_set():
                raise KeyboardInterrupt
        pending = [(p, item, part, job) for (p, item, part), job in zip(units, jobs, strict=True)]
        ended: dict[tuple[int, int], dict[str, Job]] = {}  # (plan, item key) -> its ended jobs, until all have
        while pending:
            if interrupted.is_set():
                raise KeyboardInterrupt
            # Jobs finish roughly in queue order: long-poll the oldest, then look at the ones
            # behind it until LOOKAHEAD unfinished ones are seen (a worker runs a batch of jobs
            # at once, and they end out of order within it).
            head = pending[0][3].refresh(wait=2)
            finished: list[tuple[int, Item, str, Job]] = []
            unfinished: list[Job] = []
            for p, item, part, job in pending:
                if len(unfinished) >= LOOKAHEAD:
                    break
                if job is not head:
                    job.refresh()
                if job.done:
                    finished.append((p, item, part, job))
                else:
                    unfinished.append(job)
            for p, item, part, job in finished:
                ended.setdefault((p, item.key), {})[part] = job
                if len(ended[(p, item.key)]) == len(item.requests):
                    sample = plans[p].record(item, ended.pop((p, item.key)))
                    plans[p].run.write_sample(item.key, sample)
                    counts["succeeded" if sample["status"] == "succeeded" else "failed"] += 1
                    bar.update(1)
            done_ids = {job.id for _, _, _, job in finished}
            pending = [(p, i, part, j) for p, i, part, j in pending if j.id not in done_ids]
            counts["running"] = sum(1 for job in unfinished if job.status == "running")
            counts["queued"] = len(pending) - counts["running"]
            bar.set_postfix(counts, refresh=True)
    finally:
        bar.close()

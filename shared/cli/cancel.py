"""A bulk run's jobs after the command has stopped: their run label, what is left after Ctrl-C,
and `actq cancel`, which cancels them.

Every job a bulk run (`actq run-file`, `actq gsm8k`) submits carries its run label as
`metadata.run` (shared/listing.py RUN_KEY, the tag `/runs/<label>/v1` gives OpenAI clients' jobs):
`<kind>-<the first 16 hex digits of the run id>`, e.g. `gsm8k-3f9c0a1be2d45f67`, the same on every
resume of the results directory (a steering sweep: one label per strength). `GET
/jobs?metadata.run=<label>` lists them, `actq export --label <label>` exports them.

Ctrl-C stops the command, not the jobs: the queue runs what it holds. The command then counts
the run's jobs still queued or running (through the API) and prints the `actq cancel` command
that stops them. `actq cancel --run LABEL` (or `--jobs` filters, as `actq export --jobs`) lists
the caller's jobs that match and asks `POST /jobs/{id}/cancel` of each unfinished one: a queued
job ends `cancelled` at once, a running one within a decoding step; a finished job is never
touched (cancel never deletes).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from dataclasses import dataclass, field

from shared.client import Client, Conflict, Job, NotFound
from shared.errors import ToolError
from shared.listing import RUN_KEY
from shared.retries import RetryPolicy
from shared.states import TERMINAL_NAMES

UNFINISHED = ("queued", "running")
_NOT_IN_LABEL = re.compile(r"[^A-Za-z0-9._-]+")


def run_label(kind: str, run_id: str) -> str:
    """A results directory's run label: its kind and run id, in the characters a label may hold
    (api/run_labels.py: letters, digits, '.', '_', '-'; at most 64)."""
    kind = _NOT_IN_LABEL.sub("-", kind).strip("-._") or "run"
    return f"{kind[:47]}-{run_id[:16]}"


def command(labels: list[str], api: str) -> str:
    """The `actq cancel` command line for these run labels at this API."""
    runs = " ".join(f"--run {shlex.quote(label)}" for label in labels)
    return f"actq cancel {runs} --api {shlex.quote(api)}"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a bulk run, after its results directory was left consistent: its run labels and
    how many of their jobs were still queued and running (None: they could not be counted)."""

    def __init__(self, labels: list[str], api: str, left: Counter | None, why: str = "") -> None:
        super().__init__()
        self.labels, self.api, self.left, self.why = labels, api, left, why

    def report(self) -> str:
        """What the user reads: the jobs left running on the queue, and how to cancel them."""
        runs = ", ".join(self.labels)
        run = f"run {runs}" if len(self.labels) == 1 else f"runs {runs}"
        if self.left is None:
            return (
                f"the jobs of {run} may still be queued or running (they could not be counted: {self.why}); "
                f"to cancel them: {command(self.labels, self.api)}"
            )
        queued, running = self.left["queued"], self.left["running"]
        if queued + running == 0:
            return f"no job of {run} is still queued or running"
        return (
            f"{queued + running} jobs of {run} are still on the queue ({queued} queued, {running} running) and will "
            f"run to their end; to cancel them: {command(self.labels, self.api)}"
        )


def interrupted(client: Client, labels: list[str]) -> Interrupted:
    """Count the unfinished jobs of the runs (asked once: no retry waits after Ctrl-C)."""
    client.retry = RetryPolicy(seconds=0)
    try:
        left: Counter = Counter()
        for label in labels:
            for status in UNFINISHED:
                left[status] += len(client.jobs(metadata={RUN_KEY: label}, status=status, limit=None))
    except Exception as exc:  # noqa: BLE001  # any failure: the report says it could not count
        return Interrupted(labels, client.base_url, None, " ".join(str(exc).split())[:300])
    return Interrupted(labels, client.base_url, left)


@dataclass
class Cancelled:
    """What `actq cancel` did: jobs cancelled while queued, running jobs asked to stop, jobs that
    had already finished (by state), and jobs gone before they could be cancelled."""

    queued: int = 0
    running: int = 0
    finished: Counter = field(default_factory=Counter)
    gone: int = 0

    def line(self, what: str) -> str:
        finished = self.finished
        ended = ", ".join(f"{n} {state}" for state, n in sorted(finished.items()))
        line = (
            f"{what}: cancelled {self.queued + self.running} jobs ({self.queued} queued, {self.running} running: "
            f"stopped within a decoding step); {sum(finished.values())} had already finished"
        )
        line += f" ({ended})" if ended else ""
        return line + (f"; {self.gone} were deleted meanwhile" if self.gone else "")


def cancel(client: Client, metadata: dict[str, str], user: str | None, created_after: str | None) -> Cancelled:
    """Cancel every unfinished job of the caller that passes the filters (GET /jobs)."""
    summaries = client.jobs(metadata=metadata, user=user, created_after=created_after, limit=None)
    if not summaries:
        shown = " ".join([*(f"metadata.{k}={v}" for k, v in metadata.items()), *([f"user={user}"] if user else [])])
        raise ToolError(f"no job of this API key passes {shown or 'the filters'} (GET /jobs lists none)")
    done = Cancelled()
    for summary in summaries:
        if summary["status"] in TERMINAL_NAMES:
            done.finished[summary["status"]] += 1
            continue
        try:
            job = Job(client, summary).cancel()
        except Conflict:  # it ended between the listing and the cancel
            done.finished[Job(client, summary).refresh().status] += 1
            continue
        except NotFound:
            done.gone += 1
            continue
        if job.status == "cancelled":
            done.queued += 1
        else:
            done.running += 1
    return done


def cancel_selected(client: Client, runs: list[str], filters: list[str]) -> list[str]:
    """`actq cancel`: the jobs of each run label in `runs`, or those passing `filters` (`--jobs`,
    as `actq export --jobs`), cancelled; a line for each selection."""
    from shared.cli import export_jobs

    selections = [{f"{export_jobs.METADATA}{RUN_KEY}": label} for label in runs]
    if filters:
        selections.append(export_jobs.parse_filters(filters))
    lines = []
    for params in selections:
        metadata = {k.removeprefix(export_jobs.METADATA): v for k, v in params.items() if k.startswith("metadata.")}
        done = cancel(client, metadata, params.get("user"), params.get("created_after"))
        lines.append(done.line(f"run {metadata[RUN_KEY]}" if not filters else export_jobs.describe(params)))
    return lines

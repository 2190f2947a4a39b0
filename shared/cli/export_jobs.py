"""The jobs `actq export --jobs` picks, as the samples export.py writes.

Each `--jobs` is a GET /jobs filter: `metadata.<key>=<value>`, `user=<name>` or
`created_after=<ISO time>`; several must all hold. The caller's jobs that pass them are listed
(every page, along the API's cursor) and exported in submission order, oldest first, each as a
sample of one source ("generated", as an `actq run-file` line): its request as stored
(`GET /jobs/{id}/request`: the whole prompt or messages), its result and manifest
(`GET /jobs/{id}`), its tensors one at a time through the API. Its rows also carry the job's
`created_at`, `user`, and a `metadata.<key>` column for every key a picked job holds, so that a
client that could not tag each request (lm-eval) can match rows to its own samples by prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from shared.client import Client
from shared.errors import ToolError

FILTERS = ("user", "created_after")
METADATA = "metadata."
EXAMPLE = "--jobs metadata.run=lmeval1 (or user=NAME, created_after=2025-01-31T12:00:00Z)"


def parse_filters(given: list[str]) -> dict[str, str]:
    """`--jobs` values as GET /jobs query parameters; a ToolError for one it does not take."""
    params: dict[str, str] = {}
    for text in given:
        name, sep, value = text.partition("=")
        if not sep or not (name in FILTERS or (name.startswith(METADATA) and len(name) > len(METADATA))):
            raise ToolError(f"--jobs {text!r} is not a job filter: give {EXAMPLE}")
        if name in params:
            raise ToolError(f"--jobs names {name} twice; a job holds one value for it")
        params[name] = value
    return params


def picked(client: Client, params: dict[str, str]) -> list[dict]:
    """Summaries of the caller's jobs that pass `params`, oldest first."""
    metadata = {name.removeprefix(METADATA): v for name, v in params.items() if name.startswith(METADATA)}
    newest_first = client.jobs(
        metadata=metadata, user=params.get("user"), created_after=params.get("created_after"), limit=None
    )
    if not newest_first:
        shown = " ".join(f"{k}={v}" for k, v in params.items())
        raise ToolError(f"no job of this API key passes --jobs {shown} (GET /jobs lists none)")
    return newest_first[::-1]


def columns(summaries: list[dict]) -> list[str]:
    """The job columns of the export: created_at, user, and metadata.<key> for each key held."""
    keys = sorted({key for s in summaries for key in (s.get("metadata") or {})})
    return ["created_at", "user", *(METADATA + key for key in keys)]


def samples(client: Client, summaries: list[dict], names: list[str], skip: set | None = None) -> Iterator[dict]:
    """One sample per job, in order, but the jobs in `skip` (exported before: never fetched
    again); a job that did not succeed with activations is not read further than its summary
    (export counts it as skipped)."""
    for index, summary in enumerate(summaries):
        if skip and summary["id"] in skip:
            continue
        metadata = summary.get("metadata") or {}
        sample: dict[str, Any] = {
            "index": index,
            "job_id": summary["id"],
            "status": summary["status"],
            "activations": None,
            "columns": {
                "created_at": datetime.fromisoformat(summary["created_at"]),
                "user": summary.get("user"),
                **{name: metadata.get(name.removeprefix(METADATA)) for name in names if name.startswith(METADATA)},
            },
        }
        if summary["status"] == "succeeded" and summary.get("activations"):
            job = client.job(summary["id"])
            request = job.request()
            result = job.result
            sample.update(
                mode=request.get("mode"),
                prompt=request.get("prompt"),
                messages=request.get("messages"),
                text=None if result is None else result.text,
                prompt_tokens=None if result is None else result.usage.prompt_tokens,
                completion_span=None
                if result is None or result.completion_span is None
                else list(result.completion_span),
                activations=job.manifest,
            )
        yield sample


def describe(params: dict[str, str]) -> str:
    return "--jobs " + json.dumps(params, ensure_ascii=False)

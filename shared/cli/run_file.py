"""`actq run-file PROMPTS.jsonl --out DIR`: any prompt file through the queue, with the bulk
runner's batch submission, progress, resume without duplicates and results directory.

Each line is a JSON object with:
- `prompt` (a raw text prompt) or `messages` (a chat): exactly one;
- optionally `id` (a string or number, unique in the file; default: the line's number from 0);
- optionally job fields: `mode` ("generate" or "trace"), `max_tokens`, `temperature`, `top_p`,
  `seed`, `stop`, `logprobs`, `top_logprobs`, `time_limit`. A line's own value wins over the
  command's --max-tokens and --temperature;
- any other field: a label, kept in the sample's `labels` (for `actq probe --label FIELD`).

The model and the capture are the command's (--model, --module or the residual preset), the same
for every line. Blank lines are skipped but keep their number. samples/<n>.json is named after the
line's number, never after user text; the sample holds the line's `id`, `labels`, the job's text
and usage, log-probability totals and the activations manifest (and file, with --download).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.cli import batch, captures
from shared.cli.batch import Item
from shared.client import Client, Job
from shared.errors import ToolError
from shared.schemas import JobRequest
from shared.settings import Settings

JOB_FIELDS = ("mode", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs", "time_limit")
COMMAND_FIELDS = {"model": "--model", "capture": "--module and the capture options"}


def read_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number from 0, object) for each non-blank line; a clear error for anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ToolError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    lines: list[tuple[int, dict[str, Any]]] = []
    ids: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines()):
        if not raw.strip():
            continue
        where = f"{path} line {number + 1}"
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ToolError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(line, dict):
            raise ToolError(f"{where}: expected a JSON object with `prompt` or `messages`")
        if ("prompt" in line) == ("messages" in line):
            raise ToolError(f"{where}: give exactly one of `prompt` (text) or `messages` (a chat)")
        for name, option in COMMAND_FIELDS.items():
            if name in line:
                raise ToolError(f"{where}: `{name}` is the same for the whole file; set it with {option}")
        ident = line.get("id", number)
        if not isinstance(ident, str | int) or isinstance(ident, bool):
            raise ToolError(f"{where}: `id` must be a string or a number")
        if str(ident) in ids:
            raise ToolError(f"{where}: id {ident!r} is also on line {ids[str(ident)] + 1}; ids must be unique")
        ids[str(ident)] = number
        lines.append((number, line))
    if not lines:
        raise ToolError(f"{path}: no prompts (each line: a JSON object with `prompt` or `messages`)")
    return lines


def job_request(line: dict[str, Any], model: str, capture: dict | None, max_tokens: int, temperature: float) -> dict:
    """The job for one line: its prompt or messages and job fields, the command's model and capture."""
    request: dict[str, Any] = {"model": model}
    request.update({k: line[k] for k in ("prompt", "messages") if k in line})
    request.update({k: line[k] for k in JOB_FIELDS if k in line})
    trace = request.get("mode") == "trace"
    if not trace:
        request.setdefault("max_tokens", max_tokens)
        request.setdefault("temperature", temperature)
    if capture is not None:
        positions = capture.get("positions", "all")
        if trace and positions == "generated":  # a trace generates nothing: its scored text instead
            ends_with_reply = bool(line.get("messages")) and line["messages"][-1].get("role") == "assistant"
            positions = "completion" if ends_with_reply else "all"
        request["capture"] = {**capture, "positions": positions}
    return request


def _checked(path: Path, number: int, request: dict[str, Any]) -> dict[str, Any]:
    """The request as the API's schema reads it: a bad line is named before anything is queued."""
    try:
        JobRequest.model_validate(request)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the line"
        raise ToolError(f"{path} line {number + 1}: {where}: {first['msg']}") from None
    return request


def labels(line: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in line.items() if k not in {"id", "prompt", "messages", *JOB_FIELDS}}


def record(run: batch.BatchRun, item: Item, job: Job, download: bool) -> dict:
    number, line = item.data
    result = job.data.get("result") or {}
    usage = result.get("usage") or {}
    logprobs = result.get("logprobs") or {}
    return {
        "index": number,
        "id": line.get("id", number),
        "labels": labels(line),
        **{k: line[k] for k in ("prompt", "messages") if k in line},
        "mode": line.get("mode", "generate"),
        "text": result.get("text"),
        "job_id": job.id,
        "status": job.data["status"],
        "error": job.data.get("error"),
        "finish_reason": result.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "completion_span": result.get("completion_span"),
        "logprob_total": logprobs.get("total"),
        "completion_logprob": logprobs.get("completion_total"),
        **run.download(job, f"{number}.safetensors", download),
    }


def run(
    *,
    prompts: Path,
    out: Path,
    model: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    module: list[str] | None = None,
    no_capture: bool = False,
    positions: str = "generated",
    dtype: str = "float16",
    layers: str = "spread",
    reduce: str = "none",
    download: bool = False,
    api: str | None = None,
    quiet: bool = False,
) -> dict:
    """Read and check the whole file, then submit what is not done and follow it. A resumed run
    must have the same file (by content) and options."""
    prompts = Path(prompts)
    lines = read_lines(prompts)
    digest = hashlib.sha256(prompts.read_bytes()).hexdigest()
    with Client(api or Settings().api_url, timeout=60) as client:
        model, info = captures.choose_model(client, model)
        capture = captures.choose_capture(model, info, module, no_capture, positions, dtype, layers, reduce)
        settings = {
            "model": model,
            "prompts_sha256": digest,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "capture": capture,
        }
        results = batch.BatchRun(Path(out), "run-file", settings, main="job")
        items = []
        for number, line in lines:
            request = _checked(prompts, number, job_request(line, model, capture, max_tokens, temperature))
            items.append(Item(key=number, requests={"job": request}, data=(number, line)))
        return batch.execute(
            client,
            results,
            items,
            lambda item, jobs: record(results, item, jobs["job"], download),
            unit="prompt",
            quiet=quiet,
        )

"""`actq run-file PROMPTS.jsonl --out DIR`: any prompt file through the queue, with the bulk
runner's batch submission, progress, resume without duplicates and results directory.

Each line is a JSON object with:
- `prompt` (a raw text prompt) or `messages` (a chat): exactly one;
- optionally `id` (a string or number, unique in the file; default: the line's number from 0);
- optionally job fields: `mode` ("generate" or "trace"), `max_tokens`, `temperature`, `top_p`,
  `seed`, `stop`, `logprobs`, `top_logprobs`, `time_limit`, `tools`, `tool_choice`,
  `response_format`. A line's own value wins over the command's --mode, --max-tokens and
  --temperature;
- any other field: a label, kept in the sample's `labels` (for `actq probe --label FIELD`).

The model and the capture are the command's (--model, --module or the residual preset), the same
for every line. Blank lines are skipped but keep their number. samples/<n>.json is named after the
line's number, never after user text; the sample holds the line's `id`, `labels`, the job's text
and usage, log-probability totals and the activations manifest (and file, with --download).

Lines with `tools`: when any line has them, every line of the file is a conversation
(shared/cli/tool_loop.py, as `actq gsm8k --mode with-tools`): a job per turn, up to --max-turns,
the model's tool calls answered and fed back, trajectories/<n>.jsonl with every turn; a line
without tools is a conversation of one turn. The calculator (shared/calculator.py) is the only
tool actq can answer, so a line whose `tools` name any other function is refused before anything
is queued: its calls could only be recorded, never answered, and a conversation cut after its
first call has no answer to score or compare; run such a line with your own loop over POST /jobs
(or the OpenAI endpoint), which answers its tools.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.calculator import TOOL_NAME
from shared.cli import batch, captures, remote, steer, tool_loop
from shared.cli.batch import Item
from shared.client import Job
from shared.errors import ToolError
from shared.schemas import JobRequest

JOB_FIELDS = (
    "mode",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "time_limit",
    "tools",
    "tool_choice",
    "response_format",
)
MODES = ("generate", "trace")
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
    # JSONL lines end at "\n" only: str.splitlines() would also break a line at U+2028, U+2029,
    # \x85, \x0c, \x1c... that JSON allows raw inside a string.
    for number, raw in enumerate(text.split("\n")):
        if not raw.strip():
            continue
        where = f"{path} line {number + 1}"
        try:
            line = json.loads(raw, parse_constant=_not_finite, parse_float=_float, parse_int=_int)
        except json.JSONDecodeError as exc:
            raise ToolError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(line, dict):
            raise ToolError(f"{where}: expected a JSON object with `prompt` or `messages`")
        if ("prompt" in line) == ("messages" in line):
            raise ToolError(f"{where}: give exactly one of `prompt` (text) or `messages` (a chat)")
        for name, option in COMMAND_FIELDS.items():
            if name in line:
                raise ToolError(f"{where}: `{name}` is the same for the whole file; set it with {option}")
        _check_values(where, line)
        _check_tools(where, line)
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


class _Unusable:
    """A JSON value Python cannot use as a number (NaN, Infinity, 1e999, an integer past the
    int-parsing limit): kept as a marker so that the line's field can be named."""

    def __init__(self, what: str) -> None:
        self.what = what


def _not_finite(token: str) -> _Unusable:
    return _Unusable(f"{token} is not a finite number")


def _float(token: str) -> float | _Unusable:
    value = float(token)
    return value if math.isfinite(value) else _Unusable(f"{token[:20]} is not a finite number")


def _int(token: str) -> int | _Unusable:
    try:
        return int(token)
    except ValueError:  # past sys.get_int_max_str_digits()
        return _Unusable(f"an integer of {len(token.lstrip('-'))} digits is too long")


def _unusable(value: Any) -> _Unusable | None:
    if isinstance(value, _Unusable):
        return value
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for child in children if (found := _unusable(child)) is not None), None)


def _check_values(where: str, line: dict[str, Any]) -> None:
    """Every value a finite JSON number (or not a number); labels plain values (string, finite
    number, true/false, null), for the results' JSON and the export's columns."""
    for name, value in line.items():
        field = f"label `{name}`" if name in labels(line) else f"`{name}`"
        bad = _unusable(value)
        if bad is not None:
            raise ToolError(f"{where}: {field}: {bad.what}; give a finite JSON number (or a string)")
        if field.startswith("label") and isinstance(value, dict | list):
            kind = "an object" if isinstance(value, dict) else "a list"
            raise ToolError(f"{where}: {field} is {kind}; a label is a string, a finite number, true/false or null")


def _check_tools(where: str, line: dict[str, Any]) -> None:
    """A line's `tools` name only the calculator: the one tool actq answers (the module docstring says why)."""
    tools = line.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ToolError(f"{where}: `tools` must be a list of tools in OpenAI's shape")
    for i, tool in enumerate(tools):
        name = ((tool.get("function") or {}) if isinstance(tool, dict) else {}).get("name")
        if name != TOOL_NAME:
            raise ToolError(
                f"{where}: tools[{i}] is {name!r}, a tool actq cannot answer: the only tool run-file answers is "
                f"{TOOL_NAME!r} (shared.calculator.TOOL); run lines with other tools through your own loop over "
                "POST /jobs or /v1/chat/completions"
            )


def uses_tools(lines: list[tuple[int, dict[str, Any]]]) -> bool:
    return any(line.get("tools") for _, line in lines)


def job_request(
    line: dict[str, Any],
    model: str,
    capture: dict | None,
    max_tokens: int,
    temperature: float,
    mode: str = "generate",
    interventions: list[dict] | None = None,
) -> dict:
    """The job for one line: its prompt or messages and job fields, the command's model and capture;
    `mode` (--mode) for a line that does not name its own; a steering sweep's `interventions`."""
    request: dict[str, Any] = {"model": model}
    request.update({k: line[k] for k in ("prompt", "messages") if k in line})
    if mode != "generate":
        request["mode"] = mode
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
    if interventions is not None:
        request["interventions"] = interventions
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


def record(run: batch.BatchRun, item: Item, job: Job, download: bool, mode: str = "generate") -> dict:
    number, line = item.data
    result = batch.job_result(job)
    usage = result.get("usage") or {}
    logprobs = result.get("logprobs") or {}
    return {
        "index": number,
        "id": line.get("id", number),
        "labels": labels(line),
        **{k: line[k] for k in ("prompt", "messages") if k in line},
        "mode": line.get("mode", mode),
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
        **steer.interventions_of(job),
    }


def record_conversation(
    run: batch.BatchRun, conversation: tool_loop.Conversation, turns: list[dict], last: Job, max_turns: int, mode: str
) -> dict:
    """A tools file's sample: the line's fields as `record` writes them, the job fields of its
    last turn, and its conversation (tool_loop.sample_fields)."""
    item = Item(key=conversation.key, requests={}, data=conversation.data)
    return {**record(run, item, last, False, mode), **tool_loop.sample_fields(conversation.key, turns, max_turns)}


def conversation(number: int, line: dict[str, Any], request: dict[str, Any]) -> tool_loop.Conversation:
    fields = {k: v for k, v in request.items() if k != "messages"}
    return tool_loop.Conversation(key=number, messages=request.get("messages"), request=fields, data=(number, line))


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
    api_key: str | None = None,
    quiet: bool = False,
    mode: str = "generate",
    steer_options: steer.Options | None = None,
    max_turns: int = tool_loop.MAX_TURNS_DEFAULT,
    retry_timeout: float = remote.DEFAULT_SECONDS,
) -> dict:
    """Read and check the whole file, then submit what is not done and follow it. A resumed run
    must have the same file (by content) and options. Nothing is written to `out` before the API
    has accepted the first jobs (batch.BatchRun.save), so a refused request leaves no `out`. With
    `steer_options`, the whole file once per strength (shared/cli/steer.py): returns
    steering.json's content. A file with `tools` runs every line as a conversation of up to
    `max_turns` jobs (shared/cli/tool_loop.py)."""
    if mode not in MODES:
        raise ToolError(f"--mode {mode!r}: generate or trace")
    if max_turns < 1:
        raise ToolError(f"--max-turns {max_turns}: give at least 1")
    vector = steer.read_vector(steer_options) if steer_options is not None else None
    probe = None
    if steer_options is not None and steer_options.probe is not None:
        probe = steer.read_probe(steer_options.probe, vector.name if vector is not None else None)
    prompts = Path(prompts)
    lines = read_lines(prompts)
    digest = hashlib.sha256(prompts.read_bytes()).hexdigest()
    for number, line in lines:  # each line's own fields, before the API is asked anything
        _checked(prompts, number, job_request(line, "-", None, max_tokens, temperature, mode))
    tools = uses_tools(lines)
    if tools and steer_options is not None:
        raise ToolError(
            f"{prompts}: lines with `tools` run as conversations, which --steer does not sweep; leave --steer out"
        )
    with remote.reaching(api), remote.client(api, api_key, retry_seconds=retry_timeout) as client:
        model, info = captures.choose_model(client, model)
        capture = captures.choose_capture(model, info, module, no_capture, positions, dtype, layers, reduce)
        if probe is not None:
            capture = steer.capture_with_probe(capture, info, probe)

        def items_for(interventions: list[dict] | None) -> list[Item]:
            items = []
            for number, line in lines:
                request = job_request(line, model, capture, max_tokens, temperature, mode, interventions)
                items.append(
                    Item(key=number, requests={"job": _checked(prompts, number, request)}, data=(number, line))
                )
            return items

        settings = {
            "model": model,
            "prompts_sha256": digest,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "capture": capture,
            "mode": mode,
        }
        # runs written before --mode existed: every line without its own mode generated
        defaults = {"mode": "generate", "interventions": None}
        if tools:
            settings["max_turns"] = max_turns
            results = batch.BatchRun(Path(out), "run-file", {**settings, "interventions": None}, "job", defaults)
            talks = [conversation(item.key, item.data[1], item.requests["job"]) for item in items_for(None)]
            return tool_loop.execute(
                client,
                results,
                talks,
                lambda c, turns, last: record_conversation(results, c, turns, last, max_turns, mode),
                max_turns=max_turns,
                item_name="line",
                download=download,
                unit="prompt",
                quiet=quiet,
            )

        def planned(directory: Path, interventions: list[dict] | None, kind: str = "run-file") -> batch.Planned:
            results = batch.BatchRun(directory, kind, {**settings, "interventions": interventions}, "job", defaults)
            return batch.Planned(
                results,
                items_for(interventions),
                lambda item, jobs: record(results, item, jobs["job"], download, mode),
            )

        if steer_options is None or vector is None:
            return batch.execute_many(client, [planned(Path(out), None)], unit="prompt", quiet=quiet)[0]

        def strength(directory: Path, interventions: list[dict] | None, label: str) -> batch.Planned:
            return planned(directory, interventions, f"run-file-coeff={label}")

        swept, summaries = steer.sweep(client, Path(out), steer_options, vector, strength, unit="prompt", quiet=quiet)
        if probe is None:
            return steer.report(swept, summaries, steer.length_metric, "mean_completion_tokens", model)

        def fetch(view: dict, name: str):
            return client.job(view["job_id"]).tensor(name).float().numpy()

        metric = f"probe_probability:{probe.name}"
        return steer.report(swept, summaries, steer.probe_metric(probe, fetch), metric, model)

"""Result assembly: a job's result once its sequence left the batch. The text and why it ended
(stop strings cut, end of turn, length), tool calls read back, the edits' reports, and the
captured `[T, H]` tensors.

Positions. A generation of N new tokens from a P-token prompt runs N forward steps over the
P + N - 1 tokens fed to the model (the last new token is never fed back). Row i of an `all`
tensor is the activation at fed position i, i.e. while reading token_ids[i] and predicting
token_ids[i + 1]. Each tensor records `start`/`stop`, the token_ids indices of its first row
and one past its last:
  all       [0, P + N - 1)    every fed token
  prompt    [0, P)            the prompt tokens
  generated [P - 1, P + N - 1) one row per new token: row j is where completion token j was predicted
  last      [P + N - 2, P + N - 1)  the last fed position
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from shared.interventions import EditReport
from shared.schemas import CapturePoint, JobRequest
from shared.tools import ToolFormat
from worker.batch.sequence import Sequence, TokenScores
from worker.rules.stop_strings import checked_from, stop_cut
from worker.rules.tool_calls import Parsed, parse_tool_calls


@dataclass
class CapturedTensor:
    point: CapturePoint
    tensor: torch.Tensor  # [T, H] on the CPU, contiguous
    start: int
    stop: int
    features: list[int] | None = None  # the kept indices of the last dimension (None: all)


@dataclass
class Generation:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: torch.Tensor  # int64 [P + N]
    captured: list[CapturedTensor] = field(default_factory=list)
    stopped_by: str | None = None  # what the watch answered when it ended generation early
    scores: TokenScores | None = None  # log-probabilities, when asked for
    completion: tuple[int, int] | None = None  # a trace's final assistant turn, [start, stop)
    prompt_entries: int | None = None  # prompt_logprobs: the first this many `scores` are the prompt's
    interventions: list[EditReport] | None = None  # per edit and module, positions touched per step
    parsed: Parsed | None = None  # a job with tools: the calls read from the text (worker/rules/tool_calls.py)


def finish(
    seq: Sequence, request: JobRequest, tokenizer: Any, eos_ids: set[int], tool_format: ToolFormat | None
) -> Generation:
    """The job's result once its sequence left the batch (a failed one raises its failure)."""
    if seq.capture is not None:
        seq.capture.settle()  # its last decoding steps may still be on the capture writer thread
    if seq.failure is not None:
        raise seq.failure
    if seq.capture is not None and seq.capture.failure is not None:
        raise seq.capture.failure
    token_ids = seq.all_ids()[0].to("cpu", torch.int64)
    generated = token_ids[seq.prompt_tokens :]
    text, finish_reason = _text(generated, request, seq.max_tokens, tokenizer, eos_ids)
    captured = []
    if seq.capture is not None:
        captured = [
            CapturedTensor(point=point, tensor=rows, start=start, stop=stop, features=features)
            for point, rows, start, stop, features in seq.capture.tensors(len(generated))
        ]
    reports = None
    if seq.edits is not None and request.interventions:
        steps = 1 if seq.trace else len(generated)
        reports = seq.edits.reports([e.op for e in request.interventions], steps)
    parsed = None
    if request.parses_tool_calls and tool_format is not None:
        names = {tool.function.name for tool in request.tools or []}
        forced = request.forced_tools is not None
        parsed = parse_tool_calls(text, tool_format, names, cut=finish_reason == "length", forced=forced)
        # A reply cut by max_tokens after a complete call made that call (the cut one is dropped):
        # "length" only when no call was completed.
        finish_reason = "tool_calls" if parsed.calls and finish_reason in ("stop", "length") else finish_reason
    return Generation(
        interventions=reports,
        parsed=parsed,
        text=text,
        finish_reason=finish_reason,
        prompt_tokens=seq.prompt_tokens,
        completion_tokens=len(generated),
        token_ids=token_ids,
        captured=captured,
        stopped_by=seq.stopped_by,
        scores=seq.scores,
        completion=seq.completion,
        prompt_entries=seq.prompt_tokens if seq.echo else None,
    )


def _text(
    generated: torch.Tensor, request: JobRequest, max_tokens: int, tokenizer: Any, eos_ids: set[int]
) -> tuple[str, str]:
    """The completion's text and finish reason: cut before the first stop string to end after
    the first `min_tokens` tokens (worker/rules/stop_strings.py), "stop" at the end of a turn, "length"
    at max_tokens."""
    if request.trace:  # nothing generated, as a completion with max_tokens 0 ends
        return "", "length"

    def decode(ids: Any) -> str:
        return cast(str, tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one str

    text = decode(generated)
    cut = stop_cut(text, request.stop, checked_from(decode, generated.tolist(), request.min_tokens))
    if cut is not None:
        return text[:cut], "stop"
    if len(generated) and int(generated[-1]) in eos_ids:
        return text, "stop"
    return text, "length" if len(generated) >= max_tokens else "stop"

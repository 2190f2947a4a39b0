"""A job's result as its record holds it (shared/schemas.py's JobResult), shaped from what the
batch generated: text, tool calls parsed, usage, log-probabilities (inline entries with each
token's text, or only their totals when the values went to the activations file)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shared.schemas import JobResult, Logprobs, TokenLogprob, TopLogprob, Usage
from shared.tools import ToolCall
from worker.rules.tool_calls import call_id

if TYPE_CHECKING:
    from worker.batch.generation import Generation
    from worker.batch.sequence import TokenScores


def job_result(
    generation: Generation, finish_reason: str | None = None, tokenizer: object = None, inline: bool = True
) -> JobResult:
    """`finish_reason` overrides the generation's (a cancelled or timed-out job's partial result);
    without `tokenizer` no log-probabilities are shaped."""
    usage = Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=generation.completion_tokens,
        total_tokens=generation.prompt_tokens + generation.completion_tokens,
    )
    logprobs = None
    if generation.scores is not None and tokenizer is not None:
        logprobs = logprobs_result(generation.scores, tokenizer, inline, generation.completion)
        logprobs.prompt_entries = generation.prompt_entries
    parsed = generation.parsed
    return JobResult(
        text=generation.text,
        tool_calls=[ToolCall.model_validate(call.openai(call_id())) for call in parsed.calls]
        if parsed is not None and parsed.calls
        else None,
        content=parsed.content if parsed is not None else None,
        tool_call_problems=[str(p) for p in parsed.problems] if parsed is not None and parsed.problems else None,
        finish_reason=finish_reason or generation.finish_reason,
        usage=usage,
        logprobs=logprobs,
        interventions=generation.interventions,
        completion_span=list(generation.completion) if generation.completion is not None else None,
    )


def logprobs_result(
    scores: TokenScores, tokenizer: Any, inline: bool, completion: tuple[int, int] | None = None
) -> Logprobs:
    """The result's `logprobs`: an entry per scored token with its text (each token decoded
    alone), or, past the inline limit, only the totals (the values are in the activations file)."""
    values = scores.values
    total = float(sum(v for v in values if v is not None))
    turn = None
    if completion is not None:  # trace entries are indexed like token_ids
        turn = float(sum(v for v in values[completion[0] : completion[1]] if v is not None))
    if not inline:
        return Logprobs(content=None, in_file=True, total=total, completion_total=turn)
    wanted = set(scores.tokens) | {i for ids in scores.top_ids for i in ids}
    text = dict(zip(wanted, tokenizer.batch_decode([[i] for i in wanted]), strict=True))
    content = [
        TokenLogprob(
            token_id=token,
            token=text[token],
            logprob=value,
            top_logprobs=[TopLogprob(token_id=i, token=text[i], logprob=v) for i, v in zip(ids, vals, strict=True)],
            rank=rank,
        )
        for token, value, ids, vals, rank in zip(
            scores.tokens, values, scores.top_ids, scores.top_values, scores.ranks, strict=True
        )
    ]
    return Logprobs(content=content, total=total, completion_total=turn)

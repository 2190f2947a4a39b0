"""A job's row, whatever batch runs it: its `Sequence` (prompt, settings, what it generated and why
it ended), its log-probability records (`TokenScores`, `score_rows`), what a failed prefill puts
back (`Undo`), a prompt being fed in chunks (`Feeding`) and a vacancy (a compacting batch's row
that is no job's). The running batches (worker/batch/running_batch.py) change it; the scheduler, the
engine core and the result shaping read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shared.capture_spec import SCORE_ROWS

if TYPE_CHECKING:
    from shared.errors import JobFailure
    from worker.hooks.capture import JobCapture, Mark
    from worker.hooks.edits import JobEdits
    from worker.model.sampling import RowSampling
    from worker.rules.constrained import Constraint

# Asked after each decoding step with the number of new tokens so far; a reason string stops.
Watch = Callable[[int], str | None]


@dataclass
class TokenScores:
    """Log-probabilities of scored tokens: `values[i]` is the log-probability of `tokens[i]` (None:
    nothing predicted it, a trace's first token), `top_ids[i]`/`top_values[i]` the `k` likeliest
    tokens at that position, `ranks[i]` the rank of `tokens[i]` there (how many tokens are at
    least as likely, itself included: 1 for the likeliest; vLLM's count); from the raw logits
    (log_softmax in float32, before any sampling setting)."""

    k: int
    tokens: list[int] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)

    def unpredicted(self, token: int) -> None:
        """A text's first token: nothing predicts it."""
        self.tokens.append(token)
        self.values.append(None)
        self.top_ids.append([])
        self.top_values.append([])
        self.ranks.append(None)

    def truncate(self, entries: int) -> None:
        """Keep the first `entries` entries (a rolled-back step's are dropped)."""
        for column in (self.tokens, self.values, self.top_ids, self.top_values, self.ranks):
            del column[entries:]

    def add(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Score `tokens` `[n]` against the logits `[n, V]` of the positions that predicted them,
        SCORE_ROWS positions at a time: the float32 log-softmax of a block is the most this holds
        beside the logits, never a copy of all `[n, V]`."""
        for start in range(0, int(tokens.shape[0]), SCORE_ROWS):
            self._add(logits[start : start + SCORE_ROWS], tokens[start : start + SCORE_ROWS])

    def _add(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        # a token the model rules out (-inf) as the lowest finite float32: JSON has no infinity
        logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1).clamp_(min=torch.finfo(torch.float32).min)
        chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device))
        self.tokens += [int(t) for t in tokens.tolist()]
        self.values += [float(v) for v in chosen[:, 0].tolist()]
        self.ranks += [int(r) for r in (logprobs >= chosen).sum(dim=-1).tolist()]
        if self.k:
            top = torch.topk(logprobs, self.k, dim=-1)
            self.top_ids += top.indices.tolist()
            self.top_values += top.values.tolist()
        else:
            self.top_ids += [[] for _ in range(len(tokens))]
            self.top_values += [[] for _ in range(len(tokens))]


def score_rows(scores: list[TokenScores], logits: torch.Tensor, tokens: list[int]) -> None:
    """`TokenScores.add` for many rows at once: row i of `logits` `[n, V]` predicted `tokens[i]`
    for `scores[i]`; one log-softmax over the rows and one transfer of the results to the host."""
    k = max(s.k for s in scores)
    table = score_table(logits, torch.tensor(tokens, device=logits.device), k)
    record_scores(scores, tokens, table.tolist(), k)


def score_table(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The scores of `tokens` `[n]` (on the logits' device) against `logits` `[n, V]`, on the
    device, without reading anything to the host: per row (its log-probability, its rank, the
    `k` likeliest tokens' log-probabilities, their ids) as float64 `[n, 2 + 2k]` (ids < 2**53:
    exact). A decoding step computes it before the step after overwrites its logits."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(logprobs.device, torch.long))
    ranks = (logprobs >= chosen).sum(dim=-1, keepdim=True)
    parts = [chosen.to(torch.float64), ranks.to(torch.float64)]
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        parts += [top.values.to(torch.float64), top.indices.to(torch.float64)]
    return torch.cat(parts, dim=1)


def record_scores(scores: list[TokenScores], tokens: list[int], host: list[list[float]], k: int) -> None:
    """Rows of a `score_table` of width `k`, read to the host, into each row's `TokenScores`."""
    for row, token, line in zip(scores, tokens, host, strict=True):
        row.tokens.append(token)
        row.values.append(line[0])
        row.ranks.append(int(line[1]))
        row.top_ids.append([int(i) for i in line[2 + k : 2 + k + row.k]])
        row.top_values.append(line[2 : 2 + row.k])


@dataclass(eq=False)  # a sequence is itself: compared by identity
class Sequence:
    """One job's sequence. `ended` says why it left the batch: eos, length, stop (a stop string,
    or the reply's grammar is complete), watch, failed, trace (a trace job: one forward pass over
    its text, nothing generated)."""

    prompt_ids: torch.Tensor  # [1, P] on the model's device
    max_tokens: int  # 0 for a trace job
    capture: JobCapture | None = None
    stops: list[str] = field(default_factory=list)
    min_tokens: int = 0  # no stop string counts before this many tokens (worker/rules/stop_strings.py)
    watch: Watch | None = None
    tag: object = None  # the caller's handle
    scores: TokenScores | None = None  # log-probabilities, when the job asked for them
    completion: tuple[int, int] | None = None  # a trace's final assistant turn, [start, stop)
    edits: JobEdits | None = None  # its interventions (worker/hooks/edits.py)
    echo: bool = False  # a generation that also scores its prompt (its prefill keeps every position's logits)
    constraint: Constraint | None = None  # the grammar its reply follows (worker/rules/constrained.py)
    sampling: RowSampling | None = None  # its sampling settings (None: greedy; worker/model/sampling.py)
    generated: list[int] = field(default_factory=list)
    ended: str | None = None
    stopped_by: str | None = None  # what the watch answered
    failure: JobFailure | None = None

    @property
    def trace(self) -> bool:
        return self.max_tokens == 0

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_ids.shape[1])

    def all_ids(self) -> torch.Tensor:
        new = torch.tensor([self.generated], dtype=self.prompt_ids.dtype, device=self.prompt_ids.device)
        return torch.cat([self.prompt_ids, new], dim=1)


@dataclass
class Undo:
    """What a prefill changes in a sequence, to put back when the prefill fails."""

    seq: Sequence
    mark: Mark | None
    scores: int
    edits: list[int] | None = None
    constrained: int = 0  # tokens its constraint had taken

    @classmethod
    def of(cls, seq: Sequence) -> Undo:
        return cls(
            seq,
            seq.capture.mark() if seq.capture is not None else None,
            len(seq.scores.values) if seq.scores is not None else 0,
            seq.edits.saved() if seq.edits is not None else None,
            seq.constraint.consumed if seq.constraint is not None else 0,
        )

    def apply(self) -> None:
        seq = self.seq
        if seq.capture is not None and self.mark is not None:
            seq.capture.reset(self.mark)
            seq.capture.failure = None
        if seq.scores is not None:
            seq.scores.truncate(self.scores)
        if seq.edits is not None and self.edits is not None:
            seq.edits.restore(self.edits)
        if seq.constraint is not None:
            seq.constraint.rollback_to(self.constrained)
        seq.generated.clear()
        seq.ended = seq.stopped_by = seq.failure = None


@dataclass(eq=False)
class Feeding:
    """A sequence whose prompt is being fed in chunks (`Decoder.feed`): its own cache so far and
    how many positions it holds."""

    seq: Sequence
    cache: Any = None
    fed: int = 0


VACANT = "vacant"  # `Sequence.ended` of a vacancy


def vacancy(pad_id: int) -> Sequence:
    """A batch row that belongs to no job: it feeds `pad_id`, nothing reads its logits, and it
    leaves with the next rows that end."""
    return Sequence(prompt_ids=torch.empty(1, 0, dtype=torch.long), max_tokens=1, generated=[pad_id], ended=VACANT)

"""The next token of every row at once: a sampler whose every setting is a per-row tensor.

Each row of the persistent batch (worker/model/input_batch.py) has its settings in the rows of
`SamplingTable`, written once when its job joins: temperature (0 is greedy), top-k, top-p, min-p,
a seed, repetition / presence / frequency penalties, a dense `logit_bias` row and `min_tokens`.
What changes per step (how many tokens a row has generated, which tokens it has seen) is passed
in by the caller, computed from the batch's own state, so the table never changes while rows
decode. `sample` applies all of them to all rows in the order
transformers' `generate` applies its own logits processors (bias, repetition penalty, minimum
length, then temperature, top-k, top-p, min-p), so a batch that mixes settings costs what one
kind costs, and a row's token depends on its own settings and logits only.

Randomness is counter-based: a row's draw at its n-th generated token is a hash of (its seed, n,
token id) turned into Gumbel noise, and the token is the argmax of the scaled scores plus that
noise, which is a draw from their softmax. No generator state lives anywhere, so the draw is the
same in any batch, slot or CUDA graph bucket, and nothing in `sample` reads the device from the
host, allocates a persistent buffer or branches on data: it can be captured in a CUDA graph and
compiled with `fullgraph=True`.

A job's settings for the table come from its request (`row_sampling`). It is the one sampler:
every kind of running batch picks its rows' tokens with it (the slots inside their step, the
others through worker/batch/batch_passes.py's `_choose`, with a table of the pass's rows), so a
seeded job draws the same tokens whichever batch runs it. A greedy job's processing is
transformers' arithmetic, so its tokens are `generate`'s (tested against the processors); a
sampled job's draws are not `generate`'s, whose multinomial reads a torch generator's state.

Presence and frequency penalties follow OpenAI's definition (vLLM's too), over the generated
tokens; the repetition penalty follows transformers' (CTRL's), over prompt and generated tokens.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.schemas import JobRequest

MASK32 = 0xFFFFFFFF
# Odd multipliers of the stream (golden ratio, and murmur3's finaliser constants).
_SEED_MIX, _STEP_MIX, _TOKEN_MIX = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35


@dataclass
class RowSampling:
    """One job's sampling settings, as the table stores them (neutral values do nothing)."""

    temperature: float = 0.0  # 0: greedy (the argmax after penalties, bias and masks)
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def features(self) -> Features:
        """What `sample` must compute for this row (a greedy row's filters cannot change its argmax)."""
        return Features(
            bias=bool(self.logit_bias),
            penalties=bool(
                self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty or self.min_tokens > 0
            ),
            filters=not self.greedy and (0 < self.top_k or self.top_p < 1.0 or self.min_p > 0),
            sampled=not self.greedy,
        )


def row_sampling(request: JobRequest) -> RowSampling:
    """The request's settings for the vectorised sampler; a job without a seed gets a random one
    (its draws are then its own, as with a fresh generator)."""
    shaping = RowSampling(
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=dict(request.logit_bias or {}),
        min_tokens=request.min_tokens,
    )
    if not request.samples:
        return shaping
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return dataclasses.replace(
        shaping,
        temperature=request.temperature,
        seed=seed,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),
        min_p=request.min_p,
    )


@dataclass(frozen=True)
class Features:
    """The parts of `sample` a batch needs, from its rows' settings (known on the host): each
    part runs for every row or for none, so a batch costs what its most demanding row needs, and
    a CUDA graph is recorded per combination in use. A row whose settings are neutral for a part
    is unchanged by it, exactly."""

    bias: bool = False  # logit_bias (its table is allocated when a row first has one)
    penalties: bool = False  # repetition, presence, frequency, min_tokens
    filters: bool = False  # top-k, top-p, min-p (one sort)
    sampled: bool = False  # some row draws (else every row takes the argmax)

    def __or__(self, other: Features) -> Features:
        return Features(
            self.bias or other.bias,
            self.penalties or other.penalties,
            self.filters or other.filters,
            self.sampled or other.sampled,
        )


EVERYTHING = Features(bias=True, penalties=True, filters=True, sampled=True)


def fold_seed(seed: int) -> int:
    """A seed of any size as the 32 bits the hash reads."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK32


def hash32(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[B, vocab]` int64 values in [0, 2**32), a function of (seed, step, token id) only: each
    row's `seeds[b]` (32-bit) and `steps[b]` (how many tokens it generated). Integer arithmetic
    in int64 keeping the low 32 bits (products wrap; the low bits stay exact). In place on one
    `[B, vocab]` buffer and one scratch: with a new tensor per operation, `sample` over 32 rows
    of SmolLM2's vocabulary took 2.4 times as long on the CPU (memory, not arithmetic)."""
    x = torch.arange(vocab, device=seeds.device, dtype=torch.int64).mul_(_TOKEN_MIX)
    x = x + ((seeds.view(-1, 1) * _SEED_MIX + steps.view(-1, 1) * _STEP_MIX) & MASK32)
    x.bitwise_and_(MASK32)
    shifted = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))
    x.mul_(_FMIX1).bitwise_and_(MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 13, out=shifted))
    x.mul_(_FMIX2).bitwise_and_(MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))


def uniform_bits(dtype: torch.dtype) -> int:
    """How many of a hash's 32 bits `open_unit` keeps for `dtype`: one fewer than its significand
    holds (float32: 23), so that k + 0.5 is exact and (2**bits - 0.5) / 2**bits, the largest
    value, is 1 - 2**-(bits + 1), which `dtype` still tells apart from 1 (its spacing below 1)."""
    return min(round(-math.log2(torch.finfo(dtype).eps)), 32)  # eps = 2**-(significand bits - 1)


def open_unit(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hash values `x` in [0, 2**32) as numbers strictly inside (0, 1) in `dtype`: the top
    `uniform_bits(dtype)` bits k give (k + 0.5) / 2**bits, computed exactly. Keeping 24 bits in
    float32 was wrong: (2**24 - 0.5) / 2**24 rounds to 1.0, whose Gumbel noise is +inf (issue 46)."""
    bits = uniform_bits(dtype)
    return (x >> (32 - bits)).to(dtype).add_(0.5).mul_(1.0 / (1 << bits))


def uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int, out_dtype=torch.float32) -> torch.Tensor:
    """`[B, vocab]` numbers strictly inside (0, 1) in `out_dtype`, a function of (seed, step,
    token id) only (`hash32`, then `open_unit`)."""
    return open_unit(hash32(seeds, steps, vocab), out_dtype)


class SamplingTable:
    """Per-row sampling settings in device tensors allocated once, `slots` rows, written when a
    job joins (`set_row`) and only read by `sample`. The per-row numbers live in two tensors (one
    write per join); their named columns are views."""

    def __init__(self, slots: int, vocab: int, eos_ids: set[int], device: torch.device | str) -> None:
        self.slots, self.vocab = slots, vocab
        self.floats = torch.zeros(slots, 6, dtype=torch.float32, device=device)
        self.ints = torch.zeros(slots, 3, dtype=torch.int64, device=device)
        self.temperature, self.top_p, self.min_p = self.floats[:, 0], self.floats[:, 1], self.floats[:, 2]
        self.repetition, self.presence, self.frequency = self.floats[:, 3], self.floats[:, 4], self.floats[:, 5]
        self.top_k, self.seed, self.min_tokens = self.ints[:, 0], self.ints[:, 1], self.ints[:, 2]
        self.top_p.fill_(1.0)
        self.repetition.fill_(1.0)
        self.top_k.fill_(vocab)
        self.device = torch.device(device)
        self.bias: torch.Tensor | None = None  # [slots, vocab], made when a row first has a logit_bias
        self.eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        for token in eos_ids:
            if 0 <= token < vocab:
                self.eos[token] = True
        self.settings: list[RowSampling | None] = [None] * slots  # the host's copy, for `features`
        self._biased = [False] * slots  # rows whose bias row is not zero

    def set_row(self, slot: int, settings: RowSampling) -> None:
        """A joining job's settings in row `slot` (eager, at join time, never in the decoding step)."""
        top_k = settings.top_k if 0 < settings.top_k < self.vocab else self.vocab
        self.floats[slot] = torch.tensor(
            [
                max(settings.temperature, 0.0),
                settings.top_p,
                settings.min_p,
                settings.repetition_penalty,
                settings.presence_penalty,
                settings.frequency_penalty,
            ]
        )
        self.ints[slot] = torch.tensor([top_k, fold_seed(settings.seed), settings.min_tokens])
        if settings.logit_bias and self.bias is None:
            self.bias = torch.zeros(self.slots, self.vocab, dtype=torch.float32, device=self.device)
        if self.bias is not None and (self._biased[slot] or settings.logit_bias):
            self.bias[slot].zero_()
            if settings.logit_bias:
                tokens = torch.tensor(list(settings.logit_bias), dtype=torch.int64)
                self.bias[slot, tokens.to(self.device)] = torch.tensor(
                    list(settings.logit_bias.values()), dtype=torch.float32
                ).to(self.device)
            self._biased[slot] = bool(settings.logit_bias)
        self.settings[slot] = settings

    def clear(self, slot: int) -> None:
        """The row's job left: its settings no longer count in `features`."""
        self.settings[slot] = None

    def features(self, part: slice) -> Features:
        found = Features()
        for settings in self.settings[part]:
            if settings is not None:
                found = found | settings.features
        return found


def token_counts(
    tokens: torch.Tensor, seen_from: torch.Tensor, seen_to: torch.Tensor, counted_from: torch.Tensor, vocab: int
):
    """What the penalties read, from each row's tokens `[B, L]`: `seen` `[B, vocab]` (bool: the
    token is among positions [seen_from, seen_to] of its row: prompt and generated) and `counts`
    `[B, vocab]` (float32: occurrences among positions [counted_from, seen_to]: the generated
    ones). Positions outside are counted in a spare column that is dropped (graph-safe: no
    boolean indexing)."""
    rows, length = tokens.shape
    at = torch.arange(length, device=tokens.device).view(1, length)
    upto = at <= seen_to.view(-1, 1)
    seen_at = torch.where(upto & (at >= seen_from.view(-1, 1)), tokens, vocab)
    counted_at = torch.where(upto & (at >= counted_from.view(-1, 1)), tokens, vocab)
    seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=tokens.device).scatter_(1, seen_at, True)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, counted_at, torch.ones_like(counted_at, dtype=torch.float32))
    return seen[:, :vocab], counts[:, :vocab]


def process(
    logits: torch.Tensor,
    table: SamplingTable,
    generated: torch.Tensor,
    penalties: tuple[torch.Tensor, torch.Tensor] | None = None,
    allowed: torch.Tensor | None = None,
    part: slice | None = None,
    features: Features = EVERYTHING,
) -> torch.Tensor:
    """The scores every row samples from: `logits` `[B, V]` float32 (the table's rows `part`,
    by default the first B) with bias, penalties, `min_tokens`, the grammar's `allowed` mask
    `[B, V]` (bool, optional), temperature, top-k, top-p and min-p applied, in transformers'
    order; only the parts in `features`. `generated` `[B]`: tokens each row has generated;
    `penalties`: (seen, counts) from `token_counts` (needed with `features.penalties`). A new
    tensor (or `logits` itself when nothing applies)."""
    rows, vocab = logits.shape
    t = _Rows(table, part if part is not None else slice(0, rows))
    scores = logits
    if features.bias and table.bias is not None:
        scores = scores + t.bias[:, :vocab]
    if features.penalties:
        assert penalties is not None
        seen, counts = penalties
        # repetition (CTRL): a seen token's score divided by the penalty when positive, times it when not
        penalty = t.repetition.view(-1, 1)
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(seen, penalised, scores)
        scores = scores - counts * t.frequency.view(-1, 1) - (counts > 0) * t.presence.view(-1, 1)
        early = (generated < t.min_tokens).view(-1, 1)
        scores = scores.masked_fill(early & t.eos[:vocab], float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if not features.sampled:
        return scores
    # temperature: greedy rows keep their scores (a positive scale changes no argmax)
    temperature = t.temperature.view(-1, 1)
    scores = scores / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    if not features.filters:
        return scores
    # top-k and top-p from one ascending sort, as transformers' warpers sort
    ordered, order = torch.sort(scores, dim=-1)
    kth = ordered.gather(1, (vocab - t.top_k.clamp(1, vocab)).view(-1, 1))
    scores = scores.masked_fill(scores < kth, float("-inf"))  # below the k-th largest value (ties stay)
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # top-p: the tokens whose ascending cumulative probability is <= 1 - p go, the top one stays
    top_p = t.top_p.view(-1, 1)
    cut = (ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p) & (top_p < 1)  # 1: off (zero-probability tokens stay)
    cut[:, -1] = False
    scores = scores.masked_fill(torch.zeros_like(cut).scatter(1, order, cut), float("-inf"))
    # min-p: below min_p times the top token's probability
    probs = scores.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    small = probs < t.min_p.view(-1, 1) * top
    small = small & (probs < top)  # the top token always stays
    return scores.masked_fill(small, float("-inf"))


def sample(
    logits: torch.Tensor,
    table: SamplingTable,
    generated: torch.Tensor,
    penalties: tuple[torch.Tensor, torch.Tensor] | None = None,
    allowed: torch.Tensor | None = None,
    part: slice | None = None,
    out: torch.Tensor | None = None,
    features: Features = EVERYTHING,
) -> torch.Tensor:
    """Every row's next token `[B]` (int64): the argmax of the processed scores for greedy rows,
    else the argmax of the scores plus the row's Gumbel noise (a draw from their softmax).
    Written into `out` (`[B]`, a persistent buffer) when given, else a new tensor. `features`:
    the parts the rows need (`SamplingTable.features`; all by default); `generated` and
    `penalties` as `process` takes them (a row's draw is a function of its seed and `generated`)."""
    rows, vocab = logits.shape
    part = part if part is not None else slice(0, rows)
    scores = process(logits, table, generated, penalties, allowed, part, features)
    if features.sampled:
        u = uniform(table.seed[part], generated, vocab)
        noisy = scores - u.log_().neg_().log_()  # Gumbel noise, -log(-log(u)), in u's own buffer
        greedy = (table.temperature[part] <= 0).view(-1, 1)
        scores = torch.where(greedy, scores, noisy)
    if out is None:
        return scores.argmax(dim=-1)
    return torch.argmax(scores, dim=-1, out=out)


class _Rows:
    """The table's rows `part`, each column sliced when first read (views: nothing is copied)."""

    def __init__(self, table: SamplingTable, part: slice) -> None:
        self._table, self._part = table, part

    def __getattr__(self, name: str) -> torch.Tensor:
        if name == "eos":
            return self._table.eos
        value = getattr(self._table, name)[self._part]
        setattr(self, name, value)
        return value

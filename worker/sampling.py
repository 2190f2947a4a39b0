"""The next token of every row at once: a sampler whose every setting is a per-row tensor.

Each row of the persistent batch (worker/input_batch.py) has its settings in the rows of
`SamplingTable`, written once when its job joins: temperature (0 is greedy), top-k, top-p, min-p,
a seed, repetition / presence / frequency penalties, a dense `logit_bias` row, `min_tokens`, and
the counts of the tokens it has seen. `sample` applies all of them to all rows in the order
transformers' `generate` applies its own logits processors (bias, repetition penalty, minimum
length, then temperature, top-k, top-p, min-p), so a batch that mixes settings costs what one
kind costs, and a row's token depends on its own settings and logits only.

Randomness is counter-based: a row's draw at its n-th generated token is a hash of (its seed, n,
token id) turned into Gumbel noise, and the token is the argmax of the scaled scores plus that
noise, which is a draw from their softmax. No generator state lives anywhere, so the draw is the
same in any batch, slot or CUDA graph bucket, and nothing in `sample` reads the device from the
host, allocates a persistent buffer or branches on data: it can be captured in a CUDA graph and
compiled with `fullgraph=True`.

Presence and frequency penalties follow OpenAI's definition (vLLM's too), over the generated
tokens; the repetition penalty follows transformers' (CTRL's), over prompt and generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


def fold_seed(seed: int) -> int:
    """A seed of any size as the 32 bits the hash reads."""
    seed &= (1 << 64) - 1
    return (seed ^ (seed >> 32)) & MASK32


def uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int, out_dtype=torch.float32) -> torch.Tensor:
    """`[B, vocab]` numbers in (0, 1), a function of (seed, step, token id) only: each row's
    `seeds[b]` (32-bit) and `steps[b]` (how many tokens it generated). Integer arithmetic in
    int64 keeping the low 32 bits (products wrap; the low bits stay exact)."""
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (seeds.view(-1, 1) * _SEED_MIX + steps.view(-1, 1) * _STEP_MIX) & MASK32
    x = (x + tokens * _TOKEN_MIX) & MASK32
    x = x ^ (x >> 16)
    x = (x * _FMIX1) & MASK32
    x = x ^ (x >> 13)
    x = (x * _FMIX2) & MASK32
    x = x ^ (x >> 16)
    # 24 bits: exact in float32, and (k + 0.5) / 2**24 is never 0 or 1
    return ((x >> 8).to(out_dtype) + 0.5) * (1.0 / (1 << 24))


class SamplingTable:
    """Per-row sampling settings and token counts in device tensors allocated once, `slots` rows:
    `set_row` writes a joining job's row, `observe` counts the tokens a step produced; `sample`
    only reads them."""

    def __init__(self, slots: int, vocab: int, eos_ids: set[int], device: torch.device | str) -> None:
        self.slots, self.vocab = slots, vocab

        def f32(*shape: int, fill: float = 0.0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.float32, device=device)

        def i64(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self.temperature = f32(slots)
        self.top_k = i64(slots, fill=vocab)
        self.top_p = f32(slots, fill=1.0)
        self.min_p = f32(slots)
        self.seed = i64(slots)
        self.repetition = f32(slots, fill=1.0)
        self.presence = f32(slots)
        self.frequency = f32(slots)
        self.min_tokens = i64(slots)
        self.bias = f32(slots, vocab)
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)  # prompt and generated tokens
        self.counts = f32(slots, vocab)  # generated tokens
        self.generated = i64(slots)  # tokens generated so far
        self.eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        for token in eos_ids:
            if 0 <= token < vocab:
                self.eos[token] = True

    def set_row(self, slot: int, settings: RowSampling, prompt: torch.Tensor) -> None:
        """A joining job's settings in row `slot`, its prompt's tokens `[P]` counted as seen (eager,
        at join time, never in the decoding step)."""
        self.temperature[slot] = max(settings.temperature, 0.0)
        self.top_k[slot] = settings.top_k if 0 < settings.top_k < self.vocab else self.vocab
        self.top_p[slot] = settings.top_p
        self.min_p[slot] = settings.min_p
        self.seed[slot] = fold_seed(settings.seed)
        self.repetition[slot] = settings.repetition_penalty
        self.presence[slot] = settings.presence_penalty
        self.frequency[slot] = settings.frequency_penalty
        self.min_tokens[slot] = settings.min_tokens
        self.bias[slot].zero_()
        for token, value in settings.logit_bias.items():
            self.bias[slot, token] = value
        self.seen[slot].zero_()
        self.seen[slot, prompt.to(self.seen.device, torch.int64)] = True
        self.counts[slot].zero_()
        self.generated[slot] = 0

    def observe(self, tokens: torch.Tensor, rows: int) -> None:
        """Count the tokens `[rows]` that rows 0..rows-1 just produced (graph-safe: in place)."""
        index = tokens[:rows].view(-1, 1)
        self.seen[:rows].scatter_(1, index, True)
        self.counts[:rows].scatter_add_(1, index, torch.ones_like(index, dtype=self.counts.dtype))
        self.generated[:rows] += 1


def process(logits: torch.Tensor, table: SamplingTable, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The scores every row samples from: `logits` `[B, V]` float32 (rows 0..B-1 of the table)
    with bias, penalties, `min_tokens`, the grammar's `allowed` mask `[B, V]` (bool, optional),
    temperature, top-k, top-p and min-p applied, in transformers' order. A new tensor."""
    rows, vocab = logits.shape
    t = table
    scores = logits + t.bias[:rows, :vocab]
    # repetition (CTRL): a seen token's score divided by the penalty when positive, times it when not
    penalty = t.repetition[:rows].view(-1, 1)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    scores = torch.where(t.seen[:rows, :vocab], penalised, scores)
    counts = t.counts[:rows, :vocab]
    scores = scores - counts * t.frequency[:rows].view(-1, 1) - (counts > 0) * t.presence[:rows].view(-1, 1)
    early = (t.generated[:rows] < t.min_tokens[:rows]).view(-1, 1)
    scores = scores.masked_fill(early & t.eos[:vocab], float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # temperature: greedy rows keep their scores (a positive scale changes no argmax)
    temperature = t.temperature[:rows].view(-1, 1)
    scores = scores / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    # top-k and top-p from one ascending sort, as transformers' warpers sort
    ordered, order = torch.sort(scores, dim=-1)
    kth = ordered.gather(1, (vocab - t.top_k[:rows].clamp(1, vocab)).view(-1, 1))
    scores = scores.masked_fill(scores < kth, float("-inf"))  # below the k-th largest value (ties stay)
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # top-p: the tokens whose ascending cumulative probability is <= 1 - p go, the top one stays
    top_p = t.top_p[:rows].view(-1, 1)
    cut = (ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p) & (top_p < 1)  # 1: off (zero-probability tokens stay)
    cut[:, -1] = False
    scores = scores.masked_fill(torch.zeros_like(cut).scatter(1, order, cut), float("-inf"))
    # min-p: below min_p times the top token's probability
    probs = scores.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    small = probs < t.min_p[:rows].view(-1, 1) * top
    small = small & (probs < top)  # the top token always stays
    return scores.masked_fill(small, float("-inf"))


def sample(
    logits: torch.Tensor, table: SamplingTable, allowed: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every row's next token `[B]` (int64): the argmax of the processed scores for greedy rows,
    else the argmax of the scores plus the row's Gumbel noise (a draw from their softmax).
    Written into `out` when given (a persistent buffer), else a new tensor."""
    rows, vocab = logits.shape
    scores = process(logits, table, allowed)
    u = uniform(table.seed[:rows], table.generated[:rows], vocab)
    noisy = scores - torch.log(-torch.log(u))
    greedy = (table.temperature[:rows] <= 0).view(-1, 1)
    chosen = torch.where(greedy, scores, noisy).argmax(dim=-1)
    if out is None:
        return chosen
    out[:rows].copy_(chosen)
    return out[:rows]

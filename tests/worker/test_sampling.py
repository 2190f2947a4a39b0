"""The vectorised sampler (worker/model/sampling.py) against transformers' own logits processors, run
row by row on the same logits with each row's own settings; presence and frequency penalties
(which transformers does not have) against OpenAI's formula written out here; the draws against
the softmax they sample from; and a row's token independent of its batch-mates and its row."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.model.sampling import (
    MASK32,
    Features,
    RowSampling,
    SamplingTable,
    fold_seed,
    hash32,
    open_unit,
    process,
    sample,
    token_counts,
    uniform,
    uniform_bits,
)

VOCAB = 97
EOS = {3, 5}


def reference(logits: torch.Tensor, s: RowSampling, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """One row's scores as `generate` would process them, with presence/frequency (OpenAI's
    formula) where vLLM applies them: after the repetition penalty."""
    ids = torch.tensor([prompt + generated])
    before = LogitsProcessorList()
    if s.logit_bias:
        before.append(SequenceBiasLogitsProcessor({(t,): v for t, v in s.logit_bias.items()}))
    if s.repetition_penalty != 1.0:
        before.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    scores = before(ids, logits.clone().unsqueeze(0))
    counts = torch.zeros(VOCAB)
    for token in generated:
        counts[token] += 1
    scores = scores - counts * s.frequency_penalty - (counts > 0).float() * s.presence_penalty
    after = LogitsProcessorList()
    if s.min_tokens:
        after.append(MinNewTokensLengthLogitsProcessor(len(prompt), s.min_tokens, torch.tensor(sorted(EOS))))
    if not s.greedy:
        if s.temperature != 1.0:
            after.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k:
            after.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            after.append(TopPLogitsWarper(s.top_p))
        if s.min_p:
            after.append(MinPLogitsWarper(s.min_p))
    return after(ids, scores)[0]


def settings(rng: random.Random) -> RowSampling:
    """A row's settings: each knob on about half the time, so a batch mixes every kind."""

    def maybe(value, neutral):
        return value if rng.random() < 0.5 else neutral

    return RowSampling(
        temperature=maybe(rng.choice([0.3, 0.7, 1.0, 1.6]), 0.0),
        top_k=maybe(rng.choice([1, 5, 40]), 0),
        top_p=maybe(rng.choice([0.5, 0.9, 0.95]), 1.0),
        min_p=maybe(rng.choice([0.05, 0.2]), 0.0),
        seed=rng.randrange(2**63),
        repetition_penalty=maybe(rng.choice([0.8, 1.2, 1.5]), 1.0),
        presence_penalty=maybe(rng.choice([-0.5, 0.6, 1.5]), 0.0),
        frequency_penalty=maybe(rng.choice([-0.3, 0.4, 1.0]), 0.0),
        logit_bias={rng.randrange(VOCAB): rng.choice([-100.0, -2.0, 3.5]) for _ in range(maybe(3, 0))},
        min_tokens=maybe(rng.choice([2, 6]), 0),
    )


@dataclass
class Rows:
    """A batch's settings in a table, and what `sample` reads per step: generated counts and
    the (seen, counts) of its tokens."""

    table: SamplingTable
    generated: torch.Tensor
    penalties: tuple[torch.Tensor, torch.Tensor]

    def part(self, lo: int, hi: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.generated[lo:hi], (self.penalties[0][lo:hi], self.penalties[1][lo:hi])


def fill(table: SamplingTable, rows: list[tuple[RowSampling, list[int], list[int]]]) -> Rows:
    """Rows joined with their settings; their tokens (prompt, then generated) counted by
    `token_counts` over a left-aligned, zero-padded history."""
    for slot, (s, _, _) in enumerate(rows):
        table.set_row(slot, s)
    width = max(len(p) + len(g) for _, p, g in rows)
    history = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, (_, prompt, generated) in enumerate(rows):
        history[i, : len(prompt) + len(generated)] = torch.tensor(prompt + generated)
    lengths = torch.tensor([len(p) + len(g) for _, p, g in rows])
    prompts = torch.tensor([len(p) for _, p, _ in rows])
    penalties = token_counts(history, torch.zeros_like(lengths), lengths - 1, prompts, table.vocab)
    return Rows(table, torch.tensor([len(g) for _, _, g in rows]), penalties)


def batch(seed: int, size: int) -> tuple[torch.Tensor, list[tuple[RowSampling, list[int], list[int]]]]:
    rng = random.Random(seed)
    logits = torch.randn(size, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    rows = []
    for _ in range(size):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        generated = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 9))]
        rows.append((settings(rng), prompt, generated))
    return logits, rows


@pytest.mark.parametrize("seed", range(12))
def test_processed_scores_equal_transformers_processors_row_by_row(seed: int) -> None:
    logits, rows = batch(seed, 16)
    state = fill(SamplingTable(16, VOCAB, EOS, "cpu"), rows)
    got = process(logits, state.table, state.generated, state.penalties)
    for index, (s, prompt, generated) in enumerate(rows):
        want = reference(logits[index], s, prompt, generated)
        if s.greedy:  # generate does not warp greedy rows: only their argmax matters
            assert int(got[index].argmax()) == int(want.argmax()), (index, s)
            continue
        kept = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got[index]), kept), (index, s)
        torch.testing.assert_close(got[index][kept], want[kept], rtol=1e-6, atol=1e-6)


def test_greedy_rows_take_the_argmax_and_min_tokens_hold_off_eos() -> None:
    logits = torch.full((2, VOCAB), -1.0)
    logits[:, 5] = 10.0  # an end-of-sequence token leads
    logits[:, 11] = 4.0
    table = SamplingTable(4, VOCAB, EOS, "cpu")
    table.set_row(0, RowSampling())
    table.set_row(1, RowSampling(min_tokens=2))
    nothing = (torch.zeros(2, VOCAB, dtype=torch.bool), torch.zeros(2, VOCAB))
    assert sample(logits, table, torch.tensor([0, 0]), nothing).tolist() == [5, 11]
    assert sample(logits, table, torch.tensor([1, 1]), nothing).tolist() == [5, 11]
    assert sample(logits, table, torch.tensor([2, 2]), nothing).tolist() == [5, 5]  # two generated: eos allowed


def test_grammar_mask_rules_tokens_out() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(3, VOCAB, dtype=torch.bool)
    allowed[:, [10, 20]] = True
    table = SamplingTable(3, VOCAB, EOS, "cpu")
    for slot, temperature in enumerate([0.0, 1.0, 5.0]):
        table.set_row(slot, RowSampling(temperature=temperature, seed=slot))
    assert set(
        sample(
            logits, table, torch.zeros(3, dtype=torch.int64), allowed=allowed, features=Features(sampled=True)
        ).tolist()
    ) <= {10, 20}


def test_draws_follow_the_softmax_they_sample_from() -> None:
    """20,000 rows of one distribution, each with its own seed: each token's share within five
    standard errors of its probability (the draws are a fixed function of the seeds: no flake)."""
    rows = 20_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.3, 1.7])
    logits = base.expand(rows, -1).clone()
    table = SamplingTable(rows, 8, set(), "cpu")
    table.temperature.fill_(0.8)
    table.seed.copy_(torch.randperm(rows * 7)[:rows])
    tokens = sample(logits, table, torch.zeros(rows, dtype=torch.int64), features=Features(sampled=True))
    share = torch.bincount(tokens, minlength=8).double() / rows
    p = (base / 0.8).softmax(-1).double()
    assert torch.all((share - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-4), (share, p)


def test_a_rows_draw_depends_on_its_seed_and_step_only() -> None:
    """Row 0's draw again in another row, beside other rows: the same token at every step; another
    step or seed: other uniforms."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    alone = SamplingTable(1, VOCAB, EOS, "cpu")
    alone.set_row(0, RowSampling(temperature=1.0, seed=42))
    crowd = SamplingTable(6, VOCAB, EOS, "cpu")
    for slot in range(6):
        crowd.set_row(slot, RowSampling(temperature=1.0 + slot, seed=slot))
    crowd.set_row(4, RowSampling(temperature=1.0, seed=42))
    many = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4))
    many[4] = logits[0]
    draws = set()
    for step in range(5):
        token = int(sample(logits, alone, torch.tensor([step]), features=Features(sampled=True))[0])
        assert token == int(sample(many, crowd, torch.full((6,), step), features=Features(sampled=True))[4])
        draws.add(token)
    assert len(draws) > 1
    u = uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), VOCAB)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_writes_into_a_persistent_buffer() -> None:
    table = SamplingTable(4, VOCAB, EOS, "cpu")
    out = torch.zeros(4, dtype=torch.int64)
    logits = torch.randn(2, VOCAB)
    got = sample(logits, table, torch.zeros(2, dtype=torch.int64), part=slice(2, 4), out=out[2:], features=Features())
    assert got.data_ptr() == out[2:].data_ptr()
    assert got.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_the_parts_a_batch_skips_change_none_of_its_tokens(seed: int) -> None:
    """`sample` runs only the parts its rows' settings need (`SamplingTable.features`); a part
    that a row's settings leave neutral changes nothing of it, so every subset of rows draws
    what it draws with every part on."""
    logits, rows = batch(seed, 16)
    rng = random.Random(seed)
    for index, (s, prompt, generated) in enumerate(rows):  # some rows plain greedy, some greedy with penalties
        if rng.random() < 0.4:
            rows[index] = (RowSampling(seed=s.seed, repetition_penalty=s.repetition_penalty), prompt, generated)
    state = fill(SamplingTable(16, VOCAB, EOS, "cpu"), rows)
    every = sample(logits, state.table, state.generated, state.penalties)
    for lo, hi in [(0, 16), (0, 5), (5, 9), (9, 16), (3, 4)]:
        part = slice(lo, hi)
        needed = state.table.features(part)
        generated, penalties = state.part(lo, hi)
        got = sample(logits[lo:hi], state.table, generated, penalties, part=part, features=needed)
        assert got.tolist() == every[lo:hi].tolist(), (lo, hi, needed)
    assert state.table.features(slice(0, 16)) == Features(bias=True, penalties=True, filters=True, sampled=True)


# -- the draw itself: strictly inside (0, 1), everywhere ----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_value_the_hash_can_give_is_strictly_inside_0_1_with_finite_noise(dtype: torch.dtype) -> None:
    """Exhaustive, not sampled: `open_unit` keeps the top `uniform_bits` bits of a 32-bit hash, so
    every hash value falls in one of 2**bits buckets; both ends of every bucket (the smallest and
    the largest 32-bit value in it) give a number strictly inside (0, 1) in `dtype`, the same for
    both ends, all distinct and increasing (computed exactly), and Gumbel noise that is finite.
    With 24 bits in float32 (the old draw), the last bucket gave exactly 1.0 and +inf noise."""
    bits = uniform_bits(dtype)
    k = torch.arange(1 << bits, dtype=torch.int64)
    low, high = k << (32 - bits), ((k + 1) << (32 - bits)) - 1
    assert int(high[-1]) == MASK32 and int(low[0]) == 0  # every 32-bit value lies in some bucket
    u = open_unit(low, dtype)
    assert u.dtype == dtype
    assert torch.equal(u, open_unit(high, dtype))
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool((u[1:] > u[:-1]).all())  # exact: no two buckets round together
    noise = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(noise).all())
    # the float32 value the old draw produced for its last bucket
    assert float((torch.tensor(float((1 << 24) - 1)) + 0.5) * (1.0 / (1 << 24))) == 1.0


def test_the_hash_stays_in_32_bits_for_any_seed_and_step() -> None:
    """`hash32`'s output is what `open_unit` was proven over: [0, 2**32) for seeds and steps at
    their extremes (folded seeds are 32-bit; steps are token counts)."""
    seeds = torch.tensor([0, 1, MASK32, fold_seed(2**64 - 1), 0x9E3779B1], dtype=torch.int64)
    steps = torch.tensor([0, 1, 2**20, 2**31 - 1, 7], dtype=torch.int64)
    x = hash32(seeds, steps, 49_152)
    assert int(x.min()) >= 0 and int(x.max()) <= MASK32


# -- statistics over many seeds: the draw never leaves the distribution --------------------------

BIG_VOCAB = 49_152  # SmolLM2's: an out-of-distribution draw hit about 0.3% of steps at this size


@pytest.mark.slow  # 64 steps at 32 x 49,152: about 25 s on 2 quiet cores (160 steps took 110 s in a loaded run)
def test_no_draw_ever_leaves_its_rows_filters_mask_or_bias() -> None:
    """32 sampled rows with mixed settings (top_k, top_p, min_p, a -100 logit_bias on the
    likeliest tokens, a grammar-like mask), each with its own seed, over 64 steps of fresh
    logits at SmolLM2's vocabulary size: 2,048 draws, every one among the tokens its processed
    scores keep (finite), allowed by its mask, and never a token biased by -100. Before the fix
    about 0.3% of draws were a token from anywhere in the vocabulary: 6 expected here, and the
    chance that the old draw passes is e**-6, 0.25% (the fix itself is proven exactly, bucket by
    bucket, by test_every_value_the_hash_can_give_is_strictly_inside_0_1_with_finite_noise)."""
    rows, steps = 32, 64
    rng = random.Random(46)
    table = SamplingTable(rows, BIG_VOCAB, EOS, "cpu")
    banned = {}
    for slot in range(rows):
        kind = slot % 5
        settings_ = RowSampling(
            temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
            top_k=rng.choice([1, 5, 40]) if kind == 0 else 0,
            top_p=rng.choice([0.5, 0.9]) if kind == 1 else 1.0,
            min_p=rng.choice([0.05, 0.2]) if kind == 2 else 0.0,
            seed=rng.randrange(2**63),
            logit_bias={t: -100.0 for t in range(slot * 7, slot * 7 + 5)} if kind == 3 else {},
        )
        table.set_row(slot, settings_)
        banned[slot] = set(settings_.logit_bias)
    allowed = torch.ones(rows, BIG_VOCAB, dtype=torch.bool)
    masked_rows = [slot for slot in range(rows) if slot % 5 == 4]
    generator = torch.Generator().manual_seed(46)
    features = table.features(slice(0, rows))
    outside = []
    for step in range(steps):
        logits = torch.randn(rows, BIG_VOCAB, generator=generator) * 3
        for slot in range(rows):  # the biased tokens lead: a -100 bias is what keeps them out
            if banned[slot]:
                logits[slot, sorted(banned[slot])] += 20
        allowed[masked_rows] = False
        allowed[masked_rows, step % 50 :: 50] = True  # ~1,000 allowed tokens, moving each step
        generated = torch.full((rows,), step, dtype=torch.int64)
        scores = process(logits, table, generated, allowed=allowed, features=features)
        tokens = sample(logits, table, generated, allowed=allowed, features=features)
        kept = torch.isfinite(scores.gather(1, tokens.view(-1, 1)))[:, 0] & allowed.gather(1, tokens.view(-1, 1))[:, 0]
        for slot, token in enumerate(tokens.tolist()):
            if not kept[slot] or token in banned[slot]:
                outside.append((step, slot, token))
    assert not outside, f"{len(outside)} of {rows * steps} draws left their distribution: {outside[:5]}"


CASES = {
    "temperature 0.7": RowSampling(temperature=0.7),
    "temperature 1.6, top_k 5": RowSampling(temperature=1.6, top_k=5),
    "top_p 0.8": RowSampling(temperature=1.0, top_p=0.8),
    "min_p 0.1": RowSampling(temperature=1.3, min_p=0.1),
    "logit_bias": RowSampling(temperature=1.0, logit_bias={0: -100.0, 3: 2.5}),
}


@pytest.mark.parametrize("case", CASES)
def test_seeded_draws_fit_the_softmax_of_the_processed_scores(case: str) -> None:
    """A chi-square goodness-of-fit test: 20,000 seeds, one draw each from the same 16 logits
    with one row's settings, against softmax(processed scores), where `process` is checked
    against transformers' own processors above. Tokens expected fewer than 5 times are pooled.
    The draws are a fixed function of the seeds: the p-value is the same every run."""
    from scipy.stats import chisquare

    rows, vocab = 20_000, 16
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    table = SamplingTable(rows, vocab, set(), "cpu")
    settings_ = CASES[case]
    for slot in range(rows):
        settings_.seed = slot * 2_654_435_761 + 12_345
        table.set_row(slot, settings_)
    logits = base.expand(rows, -1).clone()
    generated = torch.zeros(rows, dtype=torch.int64)
    features = table.features(slice(0, rows))
    tokens = sample(logits, table, generated, features=features)
    p = process(logits[:1], table, generated[:1], features=features).softmax(-1)[0].double()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert float(counts[p == 0].sum()) == 0  # nothing the filters removed is ever drawn
    expected = p * rows
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    if float(wanted[-1]) == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    result = chisquare(observed.numpy(), wanted.numpy() * (observed.sum() / wanted.sum()).item())
    assert result.pvalue > 1e-3, (case, result, observed.tolist(), wanted.tolist())

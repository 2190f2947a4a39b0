"""The vectorised sampler (worker/sampling.py) against transformers' own logits processors, run
row by row on the same logits with each row's own settings; presence and frequency penalties
(which transformers does not have) against OpenAI's formula written out here; the draws against
the softmax they sample from; and a row's token independent of its batch-mates and its row."""

from __future__ import annotations

import random

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

from worker.sampling import RowSampling, SamplingTable, process, sample, uniform

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


def fill(table: SamplingTable, rows: list[tuple[RowSampling, list[int], list[int]]]) -> None:
    """Rows joined with their prompts, then their generated tokens observed a step at a time."""
    for slot, (s, prompt, _) in enumerate(rows):
        table.set_row(slot, s, torch.tensor(prompt))
    for step in range(max(len(g) for _, _, g in rows)):
        tokens = torch.tensor([g[step] if step < len(g) else 0 for _, _, g in rows])
        table.observe(tokens, len(rows))
    for slot, (_, _, generated) in enumerate(rows):  # rows that generated less: their real count
        table.generated[slot] = len(generated)
        table.counts[slot].zero_()
        for token in generated:
            table.counts[slot, token] += 1
        table.seen[slot].zero_()
        table.seen[slot, torch.tensor(rows[slot][1] + generated)] = True


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
    table = SamplingTable(16, VOCAB, EOS, "cpu")
    fill(table, rows)
    got = process(logits, table)
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
    table.set_row(0, RowSampling(), torch.tensor([1]))
    table.set_row(1, RowSampling(min_tokens=2), torch.tensor([1]))
    assert sample(logits, table).tolist() == [5, 11]
    table.observe(torch.tensor([7, 7]), 2)
    table.observe(torch.tensor([7, 7]), 2)
    assert sample(logits, table).tolist() == [5, 5]  # two tokens generated: eos allowed again


def test_grammar_mask_rules_tokens_out() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(3, VOCAB, dtype=torch.bool)
    allowed[:, [10, 20]] = True
    table = SamplingTable(3, VOCAB, EOS, "cpu")
    for slot, temperature in enumerate([0.0, 1.0, 5.0]):
        table.set_row(slot, RowSampling(temperature=temperature, seed=slot), torch.tensor([1]))
    assert set(sample(logits, table, allowed).tolist()) <= {10, 20}


def test_draws_follow_the_softmax_they_sample_from() -> None:
    """20,000 rows of one distribution, each with its own seed: each token's share within five
    standard errors of its probability (the draws are a fixed function of the seeds: no flake)."""
    rows = 20_000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.3, 1.7])
    logits = base.expand(rows, -1).clone()
    table = SamplingTable(rows, 8, set(), "cpu")
    table.temperature.fill_(0.8)
    table.seed.copy_(torch.randperm(rows * 7)[:rows])
    tokens = sample(logits, table)
    share = torch.bincount(tokens, minlength=8).double() / rows
    p = (base / 0.8).softmax(-1).double()
    assert torch.all((share - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-4), (share, p)


def test_a_rows_draw_depends_on_its_seed_and_step_only() -> None:
    """Row 0's draw again in another row, beside other rows: the same token; another step or
    seed: other uniforms."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    alone = SamplingTable(1, VOCAB, EOS, "cpu")
    alone.set_row(0, RowSampling(temperature=1.0, seed=42), torch.tensor([1]))
    crowd = SamplingTable(6, VOCAB, EOS, "cpu")
    for slot in range(6):
        crowd.set_row(slot, RowSampling(temperature=1.0 + slot, seed=slot), torch.tensor([2]))
    crowd.set_row(4, RowSampling(temperature=1.0, seed=42), torch.tensor([1]))
    many = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4))
    many[4] = logits[0]
    for _ in range(5):
        assert int(sample(logits, alone)[0]) == int(sample(many, crowd)[4])
        alone.observe(torch.tensor([9]), 1)
        crowd.observe(torch.tensor([9] * 6), 6)
    u = uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), VOCAB)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_writes_into_a_persistent_buffer() -> None:
    table = SamplingTable(4, VOCAB, EOS, "cpu")
    out = torch.zeros(4, dtype=torch.int64)
    logits = torch.randn(2, VOCAB)
    got = sample(logits, table, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got.tolist() == logits.argmax(-1).tolist()

"""Generations that also score their prompt (`prompt_logprobs`, OpenAI's legacy `echo` with
generation) and token-id prompts: the prompt's and the generated tokens' log-probabilities equal a
plain transformers forward pass over the whole text, alone, prefilled together with padding, and
fed in chunks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.schemas import JobRequest
from tests.worker.test_batching import load_engine
from worker.batch.sequence import Feeding

pytestmark = pytest.mark.model

PROMPTS = [[1, 17, 33, 250, 9, 61], [1, 5, 300, 42, 7, 88, 120, 14, 3, 99, 201, 45]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


def echo_job(ids: list[int], max_tokens: int = 5, top: int = 0) -> JobRequest:
    return JobRequest.model_validate(
        {
            "model": "m",
            "prompt_token_ids": ids,
            "max_tokens": max_tokens,
            "logprobs": True,
            "top_logprobs": top or None,
            "prompt_logprobs": True,
        }
    )


def expected(reference, ids: list[int], generated: list[int]) -> tuple[list[float], list[list[int]]]:
    """Each token's log-probability after the first, and the 3 likeliest ids at its place, from one
    plain forward pass over prompt + generated tokens (greedy: the same tokens)."""
    whole = torch.tensor([ids + generated])
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(whole).logits[0].float(), dim=-1)
    values = [float(logprobs[i, whole[0, i + 1]]) for i in range(whole.shape[1] - 1)]
    top = [logprobs[i].topk(3).indices.tolist() for i in range(whole.shape[1] - 1)]
    return values, top


def check(generation, reference, ids: list[int]) -> None:
    generated = generation.token_ids[len(ids) :].tolist()
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([ids]), max_new_tokens=len(generated), do_sample=False, pad_token_id=0)
    assert greedy[0, len(ids) :].tolist() == generated  # the same tokens as a plain greedy generate
    scores = generation.scores
    assert generation.prompt_entries == len(ids)
    assert scores.tokens == ids + generated
    assert scores.values[0] is None  # nothing predicts the first token
    values, top = expected(reference, ids, generated)
    assert len(scores.values) == len(ids) + len(generated)
    assert max(abs(a - b) for a, b in zip(scores.values[1:], values, strict=True)) < TOLERANCE
    assert [t for t in scores.top_ids[1:]] == top


def test_an_echo_generation_scores_its_prompt_then_its_tokens(served, reference):
    ids = PROMPTS[1]
    generation = served.run(echo_job(ids, top=3), [], 5)
    check(generation, reference, ids)


def test_echo_generations_prefilled_together_with_padding_score_as_alone(served, reference):
    """Two prompts of different lengths in one left-padded prefill: each scores its own prompt."""
    jobs = [echo_job(ids, top=3) for ids in PROMPTS]
    seqs = [served.prepare(job, [], 5) for job in jobs]
    with torch.inference_mode():
        decoder = served.decoder()
        try:
            decoder.admit_many(seqs)
            while decoder.rows:
                decoder.step()
        finally:
            decoder.close()
    for job, seq, ids in zip(jobs, seqs, PROMPTS, strict=True):
        check(served.finish(seq, job), reference, ids)


def test_an_echo_prompt_fed_in_chunks_scores_every_chunk(served, reference):
    ids = PROMPTS[1]
    job = echo_job(ids, top=3)
    seq = served.prepare(job, [], 5)
    item = Feeding(seq)
    with torch.inference_mode():
        decoder = served.decoder()
        try:
            while not decoder.feed(item, 5):  # 12 tokens: chunks of 5, 5 and 2
                pass
            while decoder.rows:
                decoder.step()
        finally:
            decoder.close()
    check(served.finish(seq, job), reference, ids)


def test_token_ids_outside_the_vocabulary_fail_the_job_before_the_model_runs(served):
    from shared.errors import JobFailure

    vocab = served.info.vocab_size
    job = JobRequest.model_validate({"model": "m", "prompt_token_ids": [1, vocab + 3], "max_tokens": 2})
    with pytest.raises(JobFailure, match=rf"prompt_token_ids\[1\]={vocab + 3}"):
        served.prepare(job, [], 2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_token_ids": [1, 2], "prompt": "x"}, "exactly one of"),
        ({"prompt_token_ids": []}, "at least 1"),
        ({"prompt_token_ids": [1, -4]}, "greater than or equal to 0"),
        ({"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs needs logprobs"),
        ({"prompt": "x", "mode": "trace", "logprobs": True, "prompt_logprobs": True}, "already cover"),
    ],
)
def test_bad_token_id_and_echo_requests_say_what_to_fix(fields, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        JobRequest.model_validate({"model": "m", **fields})

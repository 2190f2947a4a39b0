"""The one-job-at-a-time decoder (worker/batch/solo.py: a model whose cache cannot be batched, or a
recurrent model at ACTQ_MAX_BATCH=1), on RecurrentGemma made to take it (it batches in state slots,
tests/worker/test_state_decoding.py; its recurrent state lives in its modules, the hardest case for
a decoder that carries the model's own cache), through the engine thread
(worker/engine/scheduler.py), each against the independent reference: plain forward hooks
that clone, on a plain `model.generate` (tests/support/reference.py), and log_softmax of the
logits `generate` returns.

Tolerance for activations: equal, or within 1e-5 of the reference tensor's max |value| (float32 on
the CPU: what `generate` computes, computed again); token ids must be equal."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.capture_spec import resolve
from shared.errors import OutOfMemory
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.architectures import BY_KEY, ONE_AT_A_TIME, Arch, available, build
from tests.support.reference import (
    encode,
    hooked_forward,
    hooked_generate,
    reference_logprobs,
    sampled_reference,
    select,
)
from worker.batch.sequence import Sequence

pytestmark = pytest.mark.model  # builds and loads tiny models in this process

TOLERANCE = 1e-5  # of the reference tensor's max |value|
LOGPROB_TOLERANCE = 1e-5
NEW_TOKENS = 10
QUESTIONS = [
    "What is 2+3? Think step by step, then answer.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Name three colours.",
]


@dataclass
class Solo:
    arch: Arch
    served: Any  # worker.batch.served.ServedModel (imported lazily: it imports torch models)


@pytest.fixture(scope="module", params=ONE_AT_A_TIME)
def solo(request, tmp_path_factory, smol_dir: Path) -> Solo:
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    arch = BY_KEY[request.param]
    if reason := available(arch):
        pytest.skip(reason)
    folder = build(arch, tmp_path_factory.mktemp("solo") / arch.key, smol_dir)
    served = ServedModel(load(Settings(model=str(folder), model_name="m")))
    assert served.solo_reason is not None and served.state_slots  # it batches in state slots...
    served.state_slots = False  # ...and takes the one-job-at-a-time decoder, as a cache that cannot batch does
    return Solo(arch, served)


def job(question: str, capture: dict | None = None, **fields) -> JobRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "capture": capture, **fields}
    return JobRequest.model_validate(body)


def prepare(served, req: JobRequest, max_tokens: int = NEW_TOKENS, watch=None) -> Sequence:
    points = resolve(req.capture, served.info) if req.capture else []
    return served.prepare(req, points, max_tokens, watch)


def through_scheduler(served, seqs: list[Sequence], **options) -> tuple[list[object], Any]:
    """Every sequence submitted at once to an engine thread (an `EngineCore` asked for batches of
    4 unless told otherwise); returns each one's outcome (its ended sequence or its failure) and
    the scheduler (its step statistics)."""
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        def done(outcome: object) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(seqs):
                finished.set()

        return Entry(seq=seqs[i], done=done)

    died: list[BaseException] = []
    options.setdefault("max_batch", served.max_batch(4))
    core = EngineCore(served, wait_s=0.0, on_death=died.append, **options)
    for i in range(len(seqs)):
        core.submit(entry(i))
    core.start()
    try:
        assert finished.wait(120), f"the engine thread did not answer every job (died: {died})"
    finally:
        core.stop()
    assert not died, died  # a job's failure is never the engine's
    return [outcomes[i] for i in range(len(seqs))], core


def every_module(served) -> list[str]:
    """Every module that sees every position: the blocks, their mixers (attention, state-space,
    convolution, linear attention), norms, MLPs and experts blocks, and what lies inside them."""
    return [m.path for m in served.info.modules if m.all_positions and m.output_dim]


def assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if torch.equal(got, want):
        return
    scale = float(want.abs().max())
    diff = float((got.float() - want).abs().max())
    assert diff <= TOLERANCE * scale, (name, diff, scale)


def reference_scores(served, question: str, new_tokens: int, k: int, **generate_kwargs):
    """`generate`'s own tokens and raw logits: (token ids [P + N], log-probabilities of the new
    tokens [N], top-k ids [N, k])."""
    messages = [{"role": "user", "content": question}]
    encoded = encode(served.tokenizer, messages)
    with torch.inference_mode():
        out = served.hf.generate(
            **encoded,
            max_new_tokens=new_tokens,
            pad_token_id=served.tokenizer.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            **generate_kwargs,
        )
    ids = out.sequences[0]
    prompt_tokens = int(encoded["input_ids"].shape[1])
    # row i of the logits predicted token prompt_tokens + i: shift by one for reference_logprobs
    logits = torch.cat([torch.zeros(prompt_tokens - 1, out.logits[0].shape[-1]), torch.cat(out.logits).float()])
    values, _, top_ids = reference_logprobs(logits, ids, prompt_tokens, k)
    return ids, values, top_ids


def test_the_engine_runs_one_job_at_a_time_with_the_model_s_own_cache(solo: Solo):
    from worker.batch.solo import SoloDecoder

    served = solo.served
    assert served.solo_reason is not None and "cache layers" in served.solo_reason
    assert served.max_batch(8) == 1
    decoder = served.decoder()
    try:
        assert isinstance(decoder, SoloDecoder)
        assert decoder.chunk_tokens is None and decoder.most_rows == 1
        seqs = [prepare(served, job(q)) for q in QUESTIONS[:2]]
        with pytest.raises(ValueError, match="one sequence at a time: asked to admit 2"):
            decoder.admit_many(seqs)
        assert decoder.rows == [] and all(not s.generated and s.ended is None for s in seqs)
    finally:
        decoder.close()


def test_greedy_jobs_equal_generate_with_forward_hooks(solo: Solo):
    """Three jobs queued at once run one after the other: every module's activations at all
    positions (one job), at the generated positions with log-probabilities (another), none (the
    third); each stops at max_tokens with exactly generate's tokens."""
    served = solo.served
    modules = every_module(served)
    assert solo.arch.block(0) in modules
    reqs = [
        job(QUESTIONS[0], {"modules": modules, "positions": "all"}),
        job(QUESTIONS[1], {"modules": modules, "positions": "generated"}, logprobs=True, top_logprobs=3),
        job(QUESTIONS[2]),
    ]
    outcomes, core = through_scheduler(served, [prepare(served, req) for req in reqs])
    assert core.stats.largest == 1
    for req, outcome in zip(reqs, outcomes, strict=True):
        gen = served.finish(outcome, req)
        messages = [{"role": "user", "content": req.messages[0].content}]
        ids, rows, prompt_tokens = hooked_generate(served.hf, served.tokenizer, messages, NEW_TOKENS, modules)
        assert torch.equal(gen.token_ids, ids), req.messages[0].content
        assert gen.finish_reason == "length" and gen.completion_tokens == NEW_TOKENS
        positions = req.capture.positions if req.capture else None
        assert [c.point.module for c in gen.captured] == (modules if positions else [])
        for captured in gen.captured:
            want = select(rows[captured.point.module], positions, prompt_tokens, NEW_TOKENS)
            assert_close(captured.tensor, want, captured.point.name)
        if req.logprobs:
            ref_ids, values, top_ids = reference_scores(served, req.messages[0].content, NEW_TOKENS, 3, do_sample=False)
            assert torch.equal(ref_ids, ids)
            assert gen.scores.tokens == ids[prompt_tokens:].tolist() and gen.scores.top_ids == top_ids.tolist()
            assert max(abs(a - b) for a, b in zip(gen.scores.values, values.tolist(), strict=True)) < LOGPROB_TOLERANCE


def test_a_seeded_sampled_job_draws_what_the_sampler_draws_from_the_model_s_own_logits(solo: Solo):
    """Sampling (temperature, top-p) with the one sampler: each token is the draw of the job's seed
    and step from the plain model's logits over the job's tokens (tests/support/reference.py
    `sampled_reference`), its log-probabilities those logits' log_softmax; another seed draws
    otherwise, and the same job batched in state slots draws the same tokens."""
    from worker.model.sampling import row_sampling

    served = solo.served
    req = job(QUESTIONS[0], temperature=0.9, top_p=0.9, seed=7, logprobs=True, top_logprobs=2)
    (outcome,), _ = through_scheduler(served, [prepare(served, req, 12)])
    gen = served.finish(outcome, req)
    drawn = sampled_reference(served.hf, gen.token_ids, gen.prompt_tokens, row_sampling(req), served.eos_ids)
    assert gen.token_ids[gen.prompt_tokens :].tolist() == drawn
    with torch.inference_mode():
        logits = served.hf(input_ids=gen.token_ids[None]).logits[0].float()
    values, _, top_ids = reference_logprobs(logits, gen.token_ids, gen.prompt_tokens, 2)
    assert gen.scores.top_ids == top_ids.tolist()
    assert max(abs(a - b) for a, b in zip(gen.scores.values, values.tolist(), strict=True)) < LOGPROB_TOLERANCE
    reseeded = job(QUESTIONS[0], temperature=0.9, top_p=0.9, seed=8)
    (outcome,), _ = through_scheduler(served, [prepare(served, reseeded, 12)])
    assert not torch.equal(served.finish(outcome, reseeded).token_ids, gen.token_ids)
    served.state_slots = True  # the same job in a batch of state slots, beside another
    try:
        (batched, _), _ = through_scheduler(served, [prepare(served, req, 12), prepare(served, job(QUESTIONS[1]), 5)])
    finally:
        served.state_slots = False
    assert torch.equal(served.finish(batched, req).token_ids, gen.token_ids)


def test_a_stop_string_and_a_watch_end_a_job_early(solo: Solo):
    served = solo.served
    full = served.run(job(QUESTIONS[2]), [], 24)
    words = full.text.split()
    assert len(words) > 2, full.text
    stop = words[len(words) // 2]
    stopped = served.run(job(QUESTIONS[2], stop=[stop]), [], 24)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.find(stop)]
    assert torch.equal(stopped.token_ids, full.token_ids[: len(stopped.token_ids)])

    def cancel(tokens: int) -> str | None:
        return "cancelled" if tokens >= 3 else None

    watched = served.run(job(QUESTIONS[2]), [], 24, watch=cancel)
    assert watched.stopped_by == "cancelled" and watched.completion_tokens == 3
    assert torch.equal(watched.token_ids, full.token_ids[: full.prompt_tokens + 3])


class FailAtStep:
    """Makes the second block raise a CUDA-style out-of-memory error (a GPU cannot run here) at
    the `at`-th decoding pass it sees (one new position), once: the first block has already run
    and written its state and its captures."""

    def __init__(self, served, arch: Arch, at: int) -> None:
        self.layer = served.hf.get_submodule(arch.block(1))
        self.forward: Callable[..., Any] = self.layer.forward
        self.at, self.seen = at, 0

    def __enter__(self) -> FailAtStep:
        def failing(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[1] == 1:
                self.seen += 1
                if self.seen == self.at:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return self.forward(*args, **kwargs)

        self.layer.forward = failing
        return self

    def __exit__(self, *exc: object) -> None:
        self.layer.forward = self.forward


def test_out_of_memory_in_a_step_fails_that_job_alone(solo: Solo):
    """The first job's third decoding step runs out of memory: that job fails as out_of_memory,
    the engine goes on, and the next job (its cache and recurrent state made afresh) still
    equals generate with forward hooks."""
    served = solo.served
    block = solo.arch.block(0)
    reqs = [job(QUESTIONS[0], {"modules": [block]}), job(QUESTIONS[1], {"modules": [block]})]
    with FailAtStep(served, solo.arch, at=3) as inject:
        outcomes, _ = through_scheduler(served, [prepare(served, req) for req in reqs])
    assert inject.seen > 3  # the second job decoded after the failure
    with pytest.raises(OutOfMemory):  # the job's answer: its sequence, ended by the failure
        served.finish(outcomes[0], reqs[0])
    gen = served.finish(outcomes[1], reqs[1])
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    ids, rows, prompt_tokens = hooked_generate(served.hf, served.tokenizer, messages, NEW_TOKENS, [block])
    assert torch.equal(gen.token_ids, ids)
    assert_close(gen.captured[0].tensor, select(rows[block], "all", prompt_tokens, NEW_TOKENS), block)


def test_traces_and_prompts_a_scheduler_would_chunk_run_whole_between_generations(solo: Solo):
    """A trace job (one forward pass, no cache) between two generations, through a scheduler
    told to batch 4 and to feed prompts in chunks of 8: the solo decoder still runs one job at a
    time, each prompt in one pass; the trace equals `model(input_ids)` with forward hooks and the
    generations equal `generate`."""
    served = solo.served
    block = solo.arch.block(0)
    trace = JobRequest.model_validate(
        {
            "model": "m",
            "mode": "trace",
            "messages": [{"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": "Red."}],
            "capture": {"modules": [block]},
        }
    )
    reqs = [job(QUESTIONS[0], {"modules": [block]}), trace, job(QUESTIONS[1], {"modules": [block]})]
    seqs = [prepare(served, req) for req in reqs]
    assert all(seq.prompt_tokens > 8 for seq in seqs)
    outcomes, core = through_scheduler(served, seqs, max_batch=4, chunk_tokens=8)
    assert core.stats.largest == 1
    traced = served.finish(outcomes[1], trace)
    rows, _ = hooked_forward(served.hf, traced.token_ids.unsqueeze(0), [block])
    assert_close(traced.captured[0].tensor, rows[block], f"trace {block}")
    for i in (0, 2):
        gen = served.finish(outcomes[i], reqs[i])
        messages = [{"role": "user", "content": reqs[i].messages[0].content}]
        ids, kept, prompt_tokens = hooked_generate(served.hf, served.tokenizer, messages, NEW_TOKENS, [block])
        assert torch.equal(gen.token_ids, ids)
        assert_close(gen.captured[0].tensor, select(kept[block], "all", prompt_tokens, NEW_TOKENS), block)

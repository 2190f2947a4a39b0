"""Batched decoding in this process: every job of a batch, joining at any step, gets its own
result, checked against the same job run alone (which test_engine.py checks bit for bit against
`generate` with forward hooks). Tolerance for activations: max |batched - solo| at most 1e-4 of
the solo tensor's max |value| (float32; for a bfloat16 or float16 capture, the dtype's rounding
step, since a float32 difference far below it can still round the other way); token ids must be
equal."""

from __future__ import annotations

import pytest
import torch

from shared.capture_spec import resolve
from shared.errors import OutOfMemory
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.architectures import BY_KEY, available, build
from worker.batch.sequence import Sequence

pytestmark = pytest.mark.model

RELATIVE_TOLERANCE = 1e-4
QUESTIONS = [
    "What is 2+3?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Count to five.",
]
CAPTURE = {"modules": ["model.layers.{0,2}", "model.layers.1.mlp", "model.norm"], "positions": "all"}


def load_engine(folder):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(folder), model_name="m")))


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


def job(question: str, max_tokens: int, capture: dict | None = CAPTURE, **fields) -> tuple[JobRequest, int]:
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "capture": capture, **fields}
    return JobRequest.model_validate(body), max_tokens


def prepare(served, req: JobRequest, max_tokens: int, watch=None) -> Sequence:
    points = resolve(req.capture, served.info) if req.capture else []
    return served.prepare(req, points, max_tokens, watch)


def run_batched(served, jobs, join_at: list[int], watches=None, wrap=None):
    """Run `jobs` in one decoder, job i joining before step `join_at[i]`; returns each job's
    Generation (or its failure) and the largest batch that ran."""
    watches = watches or [None] * len(jobs)
    seqs = [prepare(served, req, n, w) for (req, n), w in zip(jobs, watches, strict=True)]
    results: dict[int, object] = {}
    largest = 0
    with torch.inference_mode():
        decoder = served.decoder()
        if wrap is not None:
            wrap(decoder)
        try:
            step = 0
            while len(results) < len(jobs):
                for i, seq in enumerate(seqs):
                    if join_at[i] == step:
                        decoder.admit(seq)
                        if seq.ended:
                            results[i] = seq
                largest = max(largest, len(decoder.rows))
                for seq in decoder.step():
                    results[seqs.index(seq)] = seq
                step += 1
        finally:
            decoder.close()
    out = []
    for i, (req, _) in enumerate(jobs):
        try:
            out.append(served.finish(results[i], req))
        except Exception as exc:  # noqa: BLE001 - the job's failure is its result here
            out.append(exc)
    return out, largest


def solo(served, req: JobRequest, max_tokens: int):
    return served.run(req, resolve(req.capture, served.info) if req.capture else [], max_tokens)


def assert_same(batched, alone, name: str) -> float:
    """Equal tokens and text; activations within the tolerance. Returns the largest relative diff."""
    assert torch.equal(batched.token_ids, alone.token_ids), name
    assert batched.text == alone.text and batched.finish_reason == alone.finish_reason
    worst = 0.0
    for got, want in zip(batched.captured, alone.captured, strict=True):
        assert (got.start, got.stop, got.tensor.shape) == (want.start, want.stop, want.tensor.shape)
        scale = float(want.tensor.abs().max())
        diff = float((got.tensor.float() - want.tensor.float()).abs().max())
        worst = max(worst, diff / scale)
        # a half-precision capture is the float32 value rounded: one rounding step apart at most
        tolerance = max(RELATIVE_TOLERANCE, torch.finfo(want.tensor.dtype).eps)
        assert diff <= tolerance * scale, (name, got.point.name, diff, scale)
    return worst


def test_jobs_joining_at_different_steps_each_get_their_solo_result(served):
    """Different max_tokens, positions, stops and joining steps (iteration-level batching): a
    finished job leaves and the rest, with their padding trimmed, go on."""
    jobs = [
        job(QUESTIONS[0], 12),
        job(QUESTIONS[1], 20, {**CAPTURE, "positions": "generated"}),
        job(QUESTIONS[2], 6, {**CAPTURE, "positions": "prompt"}),
        job(QUESTIONS[3], 16, None),
        job(QUESTIONS[4], 9, {"modules": ["lm_head", "model.layers.1"], "positions": "generated", "dtype": "bfloat16"}),
        job(QUESTIONS[5], 14, stop=["e"]),
    ]
    batched, largest = run_batched(served, jobs, join_at=[0, 0, 3, 3, 5, 11])
    assert largest >= 4
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        assert_same(got, solo(served, req, n), f"job {i}")


def test_a_seeded_sampled_job_draws_the_same_tokens_in_a_batch(served):
    sampled = job(QUESTIONS[3], 16, None, temperature=0.9, top_p=0.9, seed=7)
    jobs = [job(QUESTIONS[0], 10, None), sampled, job(QUESTIONS[2], 16, None, temperature=1.0)]
    batched, _ = run_batched(served, jobs, join_at=[0, 2, 2])
    assert torch.equal(batched[1].token_ids, solo(served, *sampled).token_ids)


def test_a_cancelled_row_stops_and_the_others_go_on(served):
    jobs = [job(QUESTIONS[0], 16), job(QUESTIONS[1], 16), job(QUESTIONS[2], 16)]
    watch = [None, lambda tokens: "cancelled" if tokens >= 3 else None, None]
    batched, _ = run_batched(served, jobs, join_at=[0, 0, 0], watches=watch)
    assert batched[1].stopped_by == "cancelled" and batched[1].completion_tokens == 3
    for i in (0, 2):
        assert_same(batched[i], solo(served, *jobs[i]), f"job {i}")


class FailAbove:
    """Makes every forward pass of more than `limit` rows raise a CUDA-style out-of-memory error
    (a GPU cannot run here) from inside the model, after the first layer has run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.decoder = None

    def __call__(self, decoder) -> None:
        self.decoder = decoder
        layer = decoder.model.model.layers[1]
        self.forward = layer.forward

        def failing(hidden_states, *args, **kwargs):
            if hidden_states.shape[0] > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return self.forward(hidden_states, *args, **kwargs)

        layer.forward = failing
        self.layer = layer

    def undo(self) -> None:
        if self.decoder is not None:
            self.layer.forward = self.forward


def test_out_of_memory_splits_the_batch_and_every_job_still_gets_its_result(served):
    """An allocation failure in the middle of any forward pass of more than 2 rows (layer 0 has
    already written its cache and captures): the step runs again in halves, what the failed pass
    wrote undone, later batches stay at 2, and every result equals its solo run."""
    jobs = [job(q, 10) for q in QUESTIONS[:5]]
    inject = FailAbove(2)
    try:
        batched, largest = run_batched(served, jobs, join_at=[0, 0, 0, 0, 2], wrap=inject)
    finally:
        inject.undo()
    assert inject.decoder.most_rows == 2 and largest == 5  # the scheduler admits no more than most_rows
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        assert_same(got, solo(served, req, n), f"job {i}")


def test_the_scheduler_fails_only_the_job_whose_prefill_runs_out_of_memory(served):
    """Through the engine thread: three jobs queued at once; the long prompt's prefill fails with
    an injected allocation failure; the other two run together and equal their solo runs."""
    import threading

    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    jobs = [job(QUESTIONS[0], 10), job(QUESTIONS[1], 10), job(QUESTIONS[2], 10)]
    layer = served.hf.model.layers[1]
    forward = layer.forward

    def failing(hidden_states, *args, **kwargs):
        if hidden_states.shape[1] > 50:  # only the long question's prompt is this long
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(hidden_states, *args, **kwargs)

    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        def done(outcome) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(jobs):
                finished.set()

        return Entry(seq=prepare(served, *jobs[i]), done=done)

    core = EngineCore(served, max_batch=4, wait_s=0.2)
    layer.forward = failing
    try:
        for i in range(len(jobs)):
            core.submit(entry(i))
        core.start()
        assert finished.wait(120)
    finally:
        core.stop()
        layer.forward = forward
    assert isinstance(outcomes[1], OutOfMemory)
    assert core.stats.largest == 2
    for i in (0, 2):
        assert_same(served.finish(outcomes[i], jobs[i][0]), solo(served, *jobs[i]), f"job {i}")


@pytest.mark.parametrize("key", ["gemma2", "mistral", "opt", "gpt2"])
def test_other_layouts_batch_exactly(key, tmp_path, smol_dir):
    """Sliding-window caches (Gemma 2, Mistral: windows of 8, crossed by every job here), OPT's
    flattened [B * S, H] modules and GPT-2's learned positions, batched against solo."""
    arch = BY_KEY[key]
    if reason := available(arch):
        pytest.skip(reason)
    eng = load_engine(build(arch, tmp_path / key, smol_dir, chat_template=True))
    modules = [m.path for m in eng.info.modules if m.all_positions and m.output_dim]
    capture = {"modules": modules, "positions": "all"}  # every module that sees every position
    jobs = [job(q, 12, capture) for q in QUESTIONS[:4]]
    batched, largest = run_batched(eng, jobs, join_at=[0, 0, 4, 7])
    assert largest >= 3
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        assert_same(got, solo(eng, req, n), f"{key} job {i}")


def test_jobs_prefilled_together_each_get_their_solo_result(served):
    """Prompts of different lengths (4x apart) prefilled in one left-padded pass, then decoded
    together: every job's tokens, captures (prompt positions included) and log-probabilities
    equal its solo run within the tolerance; a seeded sampled job draws as alone."""
    jobs = [
        job(QUESTIONS[0], 8),
        job(QUESTIONS[1], 8, logprobs=True, top_logprobs=3),
        job(QUESTIONS[4], 6, temperature=0.9, seed=11),
        job(QUESTIONS[5], 1),  # ends with its first token: never joins the batch
    ]
    seqs = [prepare(served, req, n) for req, n in jobs]
    assert len({s.prompt_tokens for s in seqs}) > 2
    ended = {}
    with torch.inference_mode():
        decoder = served.decoder()
        try:
            decoder.admit_many(seqs)
            assert len(decoder.rows) == 3 and seqs[3].ended == "length"
            while decoder.rows:
                for seq in decoder.step():
                    ended[id(seq)] = seq
        finally:
            decoder.close()
    for (req, n), seq in zip(jobs, seqs, strict=True):
        got, want = served.finish(seq, req), solo(served, req, n)
        assert_same(got, want, req.messages[0].content[:20])
        if req.logprobs:
            assert got.scores.tokens == want.scores.tokens and got.scores.top_ids == want.scores.top_ids
            assert max(abs(a - b) for a, b in zip(got.scores.values, want.scores.values, strict=True)) < 1e-4


def test_long_prompts_fed_in_chunks_beside_a_running_batch_each_get_their_solo_result(served, monkeypatch):
    """Through the engine thread, with chunks the length of the short job's prompt: two jobs
    whose prompts are longer (one with log-probabilities, one sampled with a seed) are fed a chunk
    per turn while the short job decodes, then join its batch; every job equals its solo run."""
    import threading

    from worker.batch.batch_passes import BatchPasses
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    fed: list[tuple[int, int]] = []  # (positions fed before the chunk, rows decoding beside it)
    feed = BatchPasses.feed

    def counting(self, item, most):
        fed.append((item.fed, len(self.rows)))
        return feed(self, item, most)

    monkeypatch.setattr(BatchPasses, "feed", counting)

    jobs = [
        job(QUESTIONS[0], 24),
        job(QUESTIONS[1], 10, logprobs=True, top_logprobs=2),
        job(QUESTIONS[4], 8, {**CAPTURE, "positions": "prompt"}, temperature=0.8, seed=5),
    ]
    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        def done(outcome) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(jobs):
                finished.set()

        return Entry(seq=prepare(served, *jobs[i]), done=done)

    entries = [entry(i) for i in range(len(jobs))]
    chunk = entries[0].seq.prompt_tokens
    assert all(e.seq.prompt_tokens > chunk for e in entries[1:])
    core = EngineCore(served, max_batch=4, wait_s=0.0, chunk_tokens=chunk)
    core.submit(entries[0])
    core.start()
    try:
        for e in entries[1:]:
            core.submit(e)
        assert finished.wait(120)
    finally:
        core.stop()
    expected = sum(-(-e.seq.prompt_tokens // chunk) for e in entries[1:])
    assert len(fed) == expected and all(rows >= 1 for _, rows in fed)  # the short job decoded beside
    for i, (req, n) in enumerate(jobs):
        got, want = served.finish(outcomes[i], req), solo(served, req, n)
        assert_same(got, want, f"job {i}")
        if req.logprobs:
            assert got.scores.top_ids == want.scores.top_ids
            assert max(abs(a - b) for a, b in zip(got.scores.values, want.scores.values, strict=True)) < 1e-4


def test_rings_that_fill_many_times_hand_every_step_to_its_job(served, monkeypatch):
    """Rings of 3 steps (the slots' device rings, and the compacted decoder's staging rings): a
    full ring goes to its jobs before the next step needs its slot, across joins and leaves, so
    each job still gets exactly its solo rows."""
    import worker.hooks.step_capture

    generated = {**CAPTURE, "positions": "generated"}
    jobs = [
        job(QUESTIONS[0], 11, generated),
        job(QUESTIONS[1], 7, CAPTURE),
        job(QUESTIONS[2], 13, {**generated, "reduce": "mean"}),
        job(QUESTIONS[3], 9, generated),
    ]
    alone = [solo(served, req, n) for req, n in jobs]  # default rings (32 steps): none fills
    monkeypatch.setattr(worker.hooks.step_capture, "RING_STEPS", 3)
    batched, largest = run_batched(served, jobs, join_at=[0, 1, 1, 4])
    assert largest == 4
    for i, (got, want) in enumerate(zip(batched, alone, strict=True)):
        assert_same(got, want, f"job {i}")


def test_the_decoding_loop_goes_on_while_the_capture_writer_is_held(served, monkeypatch):
    """The capture writer thread is held (its `keep_block` waits on a gate): the loop still decodes
    every step and hands each half ring over without waiting, and once the writer goes on each
    job gets its solo rows. Were the loop to wait for the writer, the steps would never end (the
    thread running them is given two minutes)."""
    import threading

    import worker.hooks.step_capture
    from worker.hooks.capture import JobCapture

    generated = {**CAPTURE, "positions": "generated"}
    jobs = [job(QUESTIONS[1], 12, generated), job(QUESTIONS[4], 12, generated)]
    alone = [solo(served, req, n) for req, n in jobs]
    monkeypatch.setattr(worker.hooks.step_capture, "RING_STEPS", 4)  # a hand-over every 2 steps: 5 before the end
    gate, kept = threading.Event(), []
    keep_block = JobCapture.keep_block

    def held(self, block, slot, since, until):
        assert gate.wait(120), "the gate never opened"
        kept.append(until - since)
        return keep_block(self, block, slot, since, until)

    monkeypatch.setattr(JobCapture, "keep_block", held)
    seqs = [prepare(served, req, n) for req, n in jobs]
    ended: list[Sequence] = []

    def decode() -> None:
        with torch.inference_mode():
            decoder = served.decoder()
            try:
                for seq in seqs:
                    decoder.admit(seq)
                while decoder.rows:
                    ended.extend(decoder.step())
            finally:
                decoder.close()

    loop = threading.Thread(target=decode)
    loop.start()
    loop.join(120)
    assert not loop.is_alive(), "the decoding loop waited for the held capture writer"
    assert sorted(map(id, ended)) == sorted(map(id, seqs)) and kept == []
    gate.set()
    for seq, (req, _), want in zip(seqs, jobs, alone, strict=True):
        assert_same(served.finish(seq, req), want, "after the writer went on")
    # every decoding step of both jobs (11 each: the first token came from the prefill), every point at once
    assert sum(kept) == 11 * len(seqs)


def test_a_failure_on_the_capture_writer_fails_that_job_alone_and_the_writer_goes_on(served, monkeypatch):
    """`keep_block` raises for one job's rows on the writer thread: that job fails with a readable
    error, the job beside it gets its solo result, and a later batch's captures are kept."""
    from worker.hooks.capture import JobCapture

    generated = {**CAPTURE, "positions": "generated"}
    jobs = [job(QUESTIONS[0], 9, generated), job(QUESTIONS[3], 9, generated)]
    alone = [solo(served, req, n) for req, n in jobs]
    keep_block = JobCapture.keep_block
    doomed: list[JobCapture] = []

    def failing(self, *args):
        if self in doomed:
            raise RuntimeError("the writer's disk is full (injected)")
        return keep_block(self, *args)

    monkeypatch.setattr(JobCapture, "keep_block", failing)
    original_prepare = served.prepare

    def marking(req, *args, **kwargs):
        seq = original_prepare(req, *args, **kwargs)
        if req is jobs[0][0]:
            doomed.append(seq.capture)
        return seq

    monkeypatch.setattr(served, "prepare", marking)
    batched, _ = run_batched(served, jobs, join_at=[0, 0])
    assert isinstance(batched[0], Exception) and "disk is full (injected)" in str(batched[0]), batched[0]
    assert_same(batched[1], alone[1], "the job beside it")
    again, _ = run_batched(served, [jobs[1]], join_at=[0])
    assert_same(again[0], alone[1], "a later batch")


def test_with_each_step_launched_before_the_last_is_read_every_job_gets_its_solo_result(served, monkeypatch):
    """The overlap of replayed steps (SlotDecoder.overlap, on with CUDA graphs), forced on the CPU:
    each step after the first is launched before the tokens of the one before are read. Jobs join
    at different steps; one is cancelled and one hits a stop string, so each ends while the step
    after its last already ran for it (that step's token and captured row are not its); one is
    sampled with a seed; rings of 4 steps hand over every 2 steps. Each job equals its solo run."""
    import worker.hooks.step_capture
    from worker.batch.slot_decoding import SlotDecoder

    monkeypatch.setattr(worker.hooks.step_capture, "RING_STEPS", 4)
    generated = {**CAPTURE, "positions": "generated"}
    jobs = [
        job(QUESTIONS[0], 12, generated),
        job(QUESTIONS[1], 9, CAPTURE),
        job(QUESTIONS[2], 14, {**generated, "reduce": "mean"}, temperature=0.9, seed=3),
        job(QUESTIONS[3], 16, generated),
        job(QUESTIONS[4], 7, generated, stop=["e"]),
        job(QUESTIONS[5], 10, generated),
    ]
    watches = [None, None, None, lambda tokens: "cancelled" if tokens >= 5 else None, None, None]
    alone = [
        served.run(req, resolve(req.capture, served.info), n, watch)
        for (req, n), watch in zip(jobs, watches, strict=True)
    ]
    assert alone[3].stopped_by == "cancelled" and alone[4].finish_reason == "stop"
    ahead = []
    decide = SlotDecoder._ahead

    def counted(self, current):
        answer = decide(self, current)
        ahead.append(answer == "step")
        return answer

    monkeypatch.setattr(SlotDecoder, "_ahead", counted)

    returned: list[Sequence] = []

    def overlapped(decoder) -> None:
        decoder.overlap = True
        step = decoder.step

        def recorded():
            ended = step()
            returned.extend(ended)
            return ended

        decoder.step = recorded

    batched, largest = run_batched(served, jobs, join_at=[0, 0, 2, 2, 5, 9], watches=watches, wrap=overlapped)
    assert largest >= 4 and sum(ahead) > len(ahead) // 2, ahead  # most steps were launched ahead
    assert len({id(seq) for seq in returned}) == len(returned) == len(jobs)  # each row leaves once
    for i, (got, want) in enumerate(zip(batched, alone, strict=True)):
        assert got.stopped_by == want.stopped_by, f"job {i}"
        assert_same(got, want, f"job {i}")


def test_a_batch_with_log_probabilities_keeps_its_overlap_and_each_job_its_solo_scores(served, monkeypatch):
    """Overlap forced on the CPU, jobs asking for log-probabilities (one with top-3, one sampled)
    beside one that does not: the scores of a step are computed as it is launched
    (worker/batch/step_scores.py), so most steps are still launched before the last one's tokens are
    read, and every job's tokens and log-probabilities equal its solo run."""
    from worker.batch.slot_decoding import SlotDecoder

    jobs = [
        job(QUESTIONS[0], 10, None, logprobs=True, top_logprobs=3),
        job(QUESTIONS[1], 12, None),
        job(QUESTIONS[2], 9, None, logprobs=True, temperature=0.9, seed=3),
    ]
    alone = [solo(served, req, n) for req, n in jobs]
    ahead = []
    decide = SlotDecoder._ahead

    def counted(self, current):
        answer = decide(self, current)
        ahead.append(answer == "step")
        return answer

    monkeypatch.setattr(SlotDecoder, "_ahead", counted)

    def overlapped(decoder) -> None:
        decoder.overlap = True

    batched, largest = run_batched(served, jobs, join_at=[0, 0, 1], wrap=overlapped)
    assert largest == 3 and sum(ahead) > len(ahead) // 2, ahead  # most steps were launched ahead
    for i, ((req, _), got, want) in enumerate(zip(jobs, batched, alone, strict=True)):
        assert_same(got, want, f"job {i}")
        if req.logprobs:
            assert got.scores.tokens == want.scores.tokens and got.scores.top_ids == want.scores.top_ids
            assert got.scores.ranks == want.scores.ranks, f"job {i}"
            assert max(abs(a - b) for a, b in zip(got.scores.values, want.scores.values, strict=True)) < 1e-4

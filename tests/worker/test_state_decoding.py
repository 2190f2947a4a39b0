"""Recurrent and hybrid models (Mamba, Mamba-2, Jamba, GraniteMoeHybrid, Qwen3-Next, LFM2, RecurrentGemma) decode
batched: each job's recurrent state (and a hybrid's attention keys and values) in a slot of
worker/model/state_slots.py, every decoding step one pass over all running jobs (worker/batch/state_decoding.py).
Each row of a batch (different prompt lengths and max_tokens, rows joining and leaving mid-batch,
greedy and seeded sampling) is checked against the independent reference (plain forward hooks
that clone, on a plain `model.generate`; a sampled row, the sampler's draws from the plain model's
logits: tests/support/reference.py) and against its own solo run (`ServedModel.run`, a batch of one).

Tolerance for activations: as tests/worker/test_solo.py (1e-5 of the reference tensor's max
|value|, float32 on the CPU); token ids must be equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.architectures import BY_KEY, STATE_SLOTS, available, build
from tests.support.reference import hooked_forward, hooked_generate, reference_logprobs, sampled_reference, select
from tests.worker.test_solo import (
    NEW_TOKENS,
    QUESTIONS,
    FailAtStep,
    Solo,
    assert_close,
    every_module,
    job,
    prepare,
    through_scheduler,
)

pytestmark = pytest.mark.model  # builds and loads tiny models in this process

MORE = ["Say something about the sea.", "Count to five, slowly, and explain each number you say."]
LOGPROB_TOLERANCE = 1e-5  # of the largest |log-probability|


@pytest.fixture(scope="module", params=STATE_SLOTS)
def state(request, tmp_path_factory, smol_dir: Path) -> Solo:
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    arch = BY_KEY[request.param]
    if reason := available(arch):
        pytest.skip(reason)
    folder = build(arch, tmp_path_factory.mktemp("state") / arch.key, smol_dir)
    return Solo(arch, ServedModel(load(Settings(model=str(folder), model_name="m"))))


def reference(served, question: str, new_tokens: int, modules: list[str]):
    messages = [{"role": "user", "content": question}]
    return hooked_generate(served.hf, served.tokenizer, messages, new_tokens, modules)


def test_the_model_says_it_decodes_batched_and_gets_the_state_slots_decoder(state: Solo):
    from worker.batch.state_decoding import StateDecoder

    served = state.served
    assert served.solo_reason is not None and served.state_slots
    assert served.max_batch(8) == 8
    assert served.describe_decoder().startswith("batched, each job's recurrent state in a slot")
    assert served.info.decoding == served.describe_decoder()  # what the worker publishes (GET /models)
    decoder = served.decoder(4)
    try:
        assert isinstance(decoder, StateDecoder) and decoder.most_rows is None
    finally:
        decoder.close()


def test_a_row_that_leaves_frees_its_slot_and_no_other_slot_moves(state: Solo):
    """Two rows join, a third joins beside them, the shortest leaves, a fourth takes its slot: the
    slots of the others never change, and every row's tokens equal its solo run; so do its
    captures, recorded in the step's rings while the slots (and the rings with them) grow."""
    served = state.served
    lengths = [6, 3, 5, 4]
    questions = [QUESTIONS[0], QUESTIONS[2], QUESTIONS[1], MORE[0]]
    capture = {"modules": [state.arch.block(0)]}
    seqs = [prepare(served, job(q, capture), n) for q, n in zip(questions, lengths, strict=True)]
    decoder = served.decoder(2)
    ended = []
    try:
        with torch.inference_mode():
            decoder.admit_many(seqs[:2])
            assert decoder.slot_of == [0, 1]
            ended += decoder.step()
            decoder.admit_many([seqs[2]])  # the slots were full: they grow, nobody moves
            assert decoder.slot_of == [0, 1, 2] and decoder.slots.slots == 4
            while seqs[1] in decoder.rows:
                ended += decoder.step()
            assert decoder.slot_of == [0, 2]  # row 1 left: its slot is free, the others stay
            decoder.admit_many([seqs[3]])
            assert decoder.slot_of == [0, 2, 1]  # the lowest free slot
            while decoder.rows:
                ended += decoder.step()
    finally:
        decoder.close()
    assert sorted(map(id, ended)) == sorted(map(id, seqs))
    for seq, question, n in zip(seqs, questions, lengths, strict=True):
        req = job(question, capture)
        gen = served.finish(seq, req)
        assert gen.captured, question
        solo = served.run(req, [c.point for c in gen.captured], n)
        assert seq.generated == solo.token_ids[solo.prompt_tokens :].tolist(), question
        for got, alone in zip(gen.captured, solo.captured, strict=True):
            assert_close(got.tensor, alone.tensor, f"{got.point.name} vs its solo run")
        ids, _, _ = reference(served, question, n, [])
        assert torch.equal(solo.token_ids, ids)


def test_a_batch_equals_forward_hooks_and_each_job_s_solo_run(state: Solo):
    """Five jobs through the engine in batches of at most 3: different prompt lengths and
    max_tokens, so rows leave and the queued ones join mid-batch; one seeded sampled job with
    log-probabilities. Every greedy row equals `generate` with forward hooks (tokens exactly,
    every module's activations within the tolerance), the sampled one the sampler's draws from the
    plain model's logits (`sampled_reference`); each equals its own solo run."""
    from worker.model.sampling import row_sampling

    served = state.served
    modules = every_module(served)
    block = state.arch.block(0)
    lengths = [NEW_TOKENS, 4, 7, NEW_TOKENS, 6]
    questions = [*QUESTIONS, *MORE]
    positions = ["all", "generated", "all", "all", "all"]
    reqs = [
        job(questions[0], {"modules": modules, "positions": positions[0]}),
        job(questions[1], {"modules": [block], "positions": positions[1]}),
        job(questions[2], {"modules": [block]}, temperature=0.9, top_p=0.9, seed=7, logprobs=True),
        job(questions[3]),
        job(questions[4], {"modules": modules, "positions": positions[4]}),
    ]
    outcomes, core = through_scheduler(
        served, [prepare(served, r, n) for r, n in zip(reqs, lengths, strict=True)], max_batch=3
    )
    assert core.stats.largest > 1  # they decoded together
    for index, (req, outcome, n) in enumerate(zip(reqs, outcomes, lengths, strict=True)):
        gen = served.finish(outcome, req)
        question = questions[index]
        assert gen.completion_tokens == n and gen.finish_reason == "length", question
        captured = [c.point.module for c in gen.captured]
        if req.seed is not None:
            drawn = sampled_reference(served.hf, gen.token_ids, gen.prompt_tokens, row_sampling(req), served.eos_ids)
            assert gen.token_ids[gen.prompt_tokens :].tolist() == drawn
            with torch.inference_mode():
                logits = served.hf(input_ids=gen.token_ids[None]).logits[0].float()
            values, _, _ = reference_logprobs(logits, gen.token_ids, gen.prompt_tokens)
            # of the largest |log-probability|, as activations are held to their largest |value|: how
            # rows share a pass changes with the scheduler's timing, and with it the float32 sums
            # (Qwen3-Next's row differed by 1.4e-5 of log-probabilities near -11 in some runs)
            bound = LOGPROB_TOLERANCE * max(1.0, float(values.abs().max()))
            assert max(abs(a - b) for a, b in zip(gen.scores.values, values.tolist(), strict=True)) < bound
        else:
            ids, rows, prompt_tokens = reference(served, question, n, captured)
            assert torch.equal(gen.token_ids, ids), question
            for c in gen.captured:
                want = select(rows[c.point.module], positions[index], prompt_tokens, n)
                assert_close(c.tensor, want, c.point.name)
        points = [c.point for c in gen.captured]
        solo = served.run(req, points, n)
        assert torch.equal(gen.token_ids, solo.token_ids), question
        for got, alone in zip(gen.captured, solo.captured, strict=True):
            assert_close(got.tensor, alone.tensor, f"{got.point.name} vs its solo run")


def test_out_of_memory_in_a_batched_step_runs_it_in_halves_and_keeps_every_state(state: Solo):
    """The second decoding pass of a batch of two runs out of memory after the first block wrote
    its state and captures: the pass runs again in halves (one row each), nothing of the failed
    pass is kept (the slots are written only after a pass that succeeded, the captures are reset
    to their mark), both jobs still equal `generate` with forward hooks, and the scheduler is told
    to take batches of one from then on (`most_rows`)."""
    served = state.served
    block = state.arch.block(0)
    questions = QUESTIONS[:2]
    reqs = [job(q, {"modules": [block]}) for q in questions]
    seqs = [prepare(served, req) for req in reqs]
    decoder = served.decoder(2)
    try:
        with torch.inference_mode(), FailAtStep(served, state.arch, at=2) as inject:
            decoder.admit_many(seqs)
            assert len(decoder.rows) == 2
            while decoder.rows:
                decoder.step()
    finally:
        decoder.close()
    assert inject.seen > 3 and decoder.most_rows == 1
    for question, req, seq in zip(questions, reqs, seqs, strict=True):
        gen = served.finish(seq, req)
        ids, rows, prompt_tokens = reference(served, question, NEW_TOKENS, [block])
        assert torch.equal(gen.token_ids, ids)
        assert_close(gen.captured[0].tensor, select(rows[block], "all", prompt_tokens, NEW_TOKENS), block)


def test_a_trace_runs_beside_the_running_batch(state: Solo):
    """A trace job (one pass, no cache) between two decoding steps of a running batch (the state
    is in the slots, not in the model's modules), then the same jobs through a scheduler that feeds
    prompts in chunks of 8 (a prompt here still runs whole): each trace equals `model(input_ids)`
    with forward hooks and each generation equals `generate`."""
    served = state.served
    block = state.arch.block(0)
    trace = JobRequest.model_validate(
        {
            "model": "m",
            "mode": "trace",
            "messages": [{"role": "user", "content": QUESTIONS[2]}, {"role": "assistant", "content": "Red."}],
            "capture": {"modules": [block]},
        }
    )
    questions = [QUESTIONS[0], QUESTIONS[2], QUESTIONS[1]]
    reqs = [job(questions[0], {"modules": [block]}), trace, job(questions[2], {"modules": [block]})]
    direct = [prepare(served, r) for r in reqs]
    decoder = served.decoder(2)
    try:
        with torch.inference_mode():
            decoder.admit_many([direct[0], direct[2]])
            decoder.step()
            decoder.trace([direct[1]])  # beside the two running rows
            assert direct[1].ended == "trace" and len(decoder.rows) == 2
            while decoder.rows:
                decoder.step()
    finally:
        decoder.close()
    queued, _ = through_scheduler(served, [prepare(served, r) for r in reqs], max_batch=4, chunk_tokens=8)
    for outcomes in (direct, queued):
        traced = served.finish(outcomes[1], trace)
        rows, _ = hooked_forward(served.hf, traced.token_ids.unsqueeze(0), [block])
        assert_close(traced.captured[0].tensor, rows[block], f"trace {block}")
        for i in (0, 2):
            gen = served.finish(outcomes[i], reqs[i])
            ids, kept, prompt_tokens = reference(served, questions[i], NEW_TOKENS, [block])
            assert torch.equal(gen.token_ids, ids)
            assert_close(gen.captured[0].tensor, select(kept[block], "all", prompt_tokens, NEW_TOKENS), block)


def test_edits_in_a_batch_equal_the_reference_and_each_job_alone(state: Solo, monkeypatch):
    """Four edited jobs decode together, their edits in the step tables by slot (add, project_out,
    a gated add whose flags the tables keep) while a fifth's, over more intervals than a table
    holds, puts the steps it runs in on the hooks: every job's tokens and captured values equal
    plain `generate` with the reference's editing hooks, and each job's per-step counts equal its
    solo run's (one job at a time, the hooks alone)."""
    from shared.capture_spec import resolve
    from shared.intervention_check import resolve as resolve_edits
    from tests.support import edit_reference as ref
    from tests.worker.test_edits import selected, vector
    from worker.hooks.step_capture import StepRings
    from worker.hooks.step_edits import StepEdits

    applied: list[str] = []  # which path edited and captured each decoding step's values
    for cls, name in ((StepEdits, "_apply"), (StepRings, "_write")):
        real = getattr(cls, name)

        def spy(self, *args, real=real, name=name):
            applied.append(name)
            return real(self, *args)

        monkeypatch.setattr(cls, name, spy)
    served = state.served
    block, last = state.arch.block(0), every_module(served)[-1]
    width = served.info.hidden_size
    capture = {"modules": [block, last], "positions": "all"}
    v, probe = vector(width, 30, 0.5), vector(width, 31)
    many = {"prompt": [0, 2, 4], "generated": [1, 3]}  # five intervals: more than a table holds
    cases = [  # (question, edit fields, new tokens)
        (QUESTIONS[0], {"op": "add", "vector": v, "coeff": 2.0}, NEW_TOKENS),
        (QUESTIONS[1], {"op": "project_out", "vector": v, "value": 1.0, "positions": "generated"}, 5),
        (QUESTIONS[2], {"op": "add", "vector": v, "coeff": 2.0, "when": {"probe": probe, "above": 0.0}}, 7),
        (MORE[0], {"op": "add", "vector": v, "coeff": -1.0, "positions": many}, 5),
        (MORE[1], {"op": "scale", "factor": 0.5, "positions": "generated"}, 8),
    ]
    reqs = [
        JobRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": question}],
                "capture": capture,
                "interventions": [{"module": block, **fields}],
            }
        )
        for question, fields, _ in cases
    ]
    seqs = []
    for req, (_, _, n) in zip(reqs, cases, strict=True):
        points = resolve(req.capture, served.info)
        edits = resolve_edits(req.interventions, served.info, req.trace, n)
        seqs.append(served.prepare(req, points, n, None, edits))
    outcomes, core = through_scheduler(served, seqs, max_batch=4)
    assert core.stats.largest > 1
    assert "_apply" in applied and "_write" in applied  # the tables edited and the rings captured
    monkeypatch.undo()
    for req, outcome, (question, fields, n) in zip(reqs, outcomes, cases, strict=True):
        gen = served.finish(outcome, req)
        chosen = selected(fields.get("positions", "all"), gen.prompt_tokens, n)
        vec = torch.tensor(v)
        if fields["op"] == "project_out":
            edit = ref.project_out(vec, 1.0, chosen)
        elif fields["op"] == "scale":
            edit = ref.scale(0.5, None, chosen)
        else:
            edit = ref.add(vec, fields["coeff"], chosen)
            if "when" in fields:
                edit = ref.gated(edit, torch.tensor(probe), 0.0, 0.0, None)
        messages = [{"role": "user", "content": question}]
        ids, rows, _ = ref.edited_generate(
            served.hf, served.tokenizer, messages, n, [(block, "output", edit)], [block, last]
        )
        assert gen.token_ids.tolist() == ids.tolist(), fields
        for c in gen.captured:
            assert_close(c.tensor, rows[c.point.module], f"{c.point.name} with {fields['op']}")
        points = [c.point for c in gen.captured]
        edits = resolve_edits(req.interventions, served.info, req.trace, n)
        solo = served.run(req, points, n, edit_points=edits)
        assert gen.interventions[0].applied == solo.interventions[0].applied, fields
        assert gen.interventions[0].total > 0, fields

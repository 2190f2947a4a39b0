"""Trace jobs, log-probabilities and reductions in this process, against the independent
reference (tests/support/reference.py: a plain `model(input_ids)` with forward hooks that clone,
and `log_softmax` of its logits), and batched against solo."""

from __future__ import annotations

import threading

import pytest
import torch

from shared.capture_spec import resolve
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support.reference import hooked_forward, reference_logprobs

pytestmark = pytest.mark.model

LOGPROB_TOLERANCE = 1e-5  # the bar: log_softmax of a plain forward pass (float32, CPU)
RELATIVE_TOLERANCE = 1e-4  # batched vs solo activations, as tests/worker/test_batching.py
POINTS = ["model.layers.{0,2}", "model.layers.1.mlp", "model.norm"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2 + 3 = 5. #### 5"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and half as many in May."},
        {"role": "assistant", "content": "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in all. #### 72"},
    ],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi"}],
]


@pytest.fixture(scope="module")
def served(tiny_dir):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(tiny_dir), model_name="tiny")))


def trace_request(messages, capture: dict | None = None, **fields) -> JobRequest:
    body = {"model": "tiny", "mode": "trace", "messages": messages, "capture": capture, **fields}
    return JobRequest.model_validate(body)


def run(served, req: JobRequest, max_tokens: int = 0):
    points = resolve(req.capture, served.info) if req.capture else []
    return served.run(req, points, max_tokens)


def template(served, messages, generation_prompt: bool) -> list[int]:
    tokenizer = served.tokenizer
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=True)["input_ids"]
    )


@pytest.mark.parametrize("messages", CONVERSATIONS[:2], ids=["one turn", "system and turn"])
def test_a_trace_equals_one_plain_forward_pass(served, messages):
    """Tokens: the conversation rendered whole by the chat template (no generation prompt);
    activations at every position bit for bit those of `model(input_ids)`; log-probabilities
    equal log_softmax of its logits to 1e-5, top-5 alternatives included."""
    req = trace_request(messages, {"modules": POINTS, "positions": "all"}, logprobs=True, top_logprobs=5)
    got = run(served, req)
    ids = template(served, messages, generation_prompt=False)
    assert got.token_ids.tolist() == ids
    assert got.completion_tokens == 0 and got.text == "" and got.finish_reason == "length"
    start = len(template(served, messages[:-1], generation_prompt=True))
    eos = served.hf.generation_config.eos_token_id
    stop = next(i + 1 for i in range(start, len(ids)) if ids[i] == eos)
    assert got.completion == (start, stop) and stop < len(ids)  # the template's "\n" after EOS is in no turn
    modules = [p.module for p in resolve(req.capture, served.info)]
    rows, logits = hooked_forward(served.hf, torch.tensor([ids]), modules)
    assert [c.point.module for c in got.captured] == modules
    for captured in got.captured:
        assert (captured.start, captured.stop) == (0, len(ids))
        assert torch.equal(captured.tensor, rows[captured.point.module]), captured.point.name
    values, top_values, top_ids = reference_logprobs(logits, torch.tensor(ids), first=1, k=5)
    scores = got.scores
    assert scores.tokens == ids and scores.values[0] is None and scores.top_ids[0] == []
    assert torch.allclose(torch.tensor(scores.values[1:]), values, atol=LOGPROB_TOLERANCE, rtol=0)
    assert torch.allclose(torch.tensor(scores.top_values[1:]), top_values, atol=LOGPROB_TOLERANCE, rtol=0)
    assert torch.equal(torch.tensor(scores.top_ids[1:]), top_ids)
    reference = torch.log_softmax(logits[:-1].float(), dim=-1)  # position i predicts token i + 1
    own = reference.gather(1, torch.tensor(ids[1:]).view(-1, 1))
    assert scores.ranks == [None, *(reference >= own).sum(dim=-1).tolist()]  # vLLM's count


def test_completion_and_prompt_positions_split_the_text_at_the_final_turn(served):
    messages = CONVERSATIONS[1]
    full = run(served, trace_request(messages, {"modules": ["model.layers.1"], "positions": "all"}))
    start, stop = full.completion
    for positions, (lo, hi) in {
        "completion": (start, stop),
        "prompt": (0, start),
        "last": (len(full.token_ids) - 1, len(full.token_ids)),
    }.items():
        got = run(served, trace_request(messages, {"modules": ["model.layers.1"], "positions": positions}))
        (captured,) = got.captured
        assert (captured.start, captured.stop) == (lo, hi), positions
        assert torch.equal(captured.tensor, full.captured[0].tensor[lo:hi]), positions


def test_a_trace_without_a_final_assistant_turn_is_the_prompt_a_generation_gets(served):
    messages = CONVERSATIONS[2]
    got = run(served, trace_request(messages, {"modules": ["model.layers.1"], "positions": "prompt"}))
    assert got.token_ids.tolist() == template(served, messages, generation_prompt=True)
    assert got.completion is None and got.captured[0].stop == len(got.token_ids)


def test_a_raw_prompt_traces_as_the_tokenizer_gives_it(served):
    req = JobRequest.model_validate(
        {"model": "tiny", "mode": "trace", "prompt": "Question: 2 + 3?\nAnswer: 5", "logprobs": True}
    )
    got = run(served, req)
    ids = served.tokenizer("Question: 2 + 3?\nAnswer: 5")["input_ids"]
    assert got.token_ids.tolist() == ids
    _, logits = hooked_forward(served.hf, torch.tensor([ids]), [])
    values, _, _ = reference_logprobs(logits, torch.tensor(ids), first=1)
    assert torch.allclose(torch.tensor(got.scores.values[1:]), values, atol=LOGPROB_TOLERANCE, rtol=0)


def test_generated_tokens_log_probabilities_equal_those_of_generate(served):
    """A generation job's logprobs: each generated token scored by log_softmax of the raw logits
    of the step that produced it (before any sampling setting). Reference: HF `generate`'s own
    logits (output_logits), to 1e-5; and a plain forward pass over prompt + answer, which
    computes the same numbers without a KV cache: within 1e-4 (float32 rounding; 2e-5 measured)."""
    req = JobRequest.model_validate(
        {"model": "tiny", "messages": CONVERSATIONS[2], "logprobs": True, "top_logprobs": 3}
    )
    got = run(served, req, max_tokens=12)
    prompt = got.token_ids[: got.prompt_tokens].unsqueeze(0)
    with torch.inference_mode():
        out = served.hf.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=served.tokenizer.eos_token_id,
        )
    assert out.sequences[0].tolist() == got.token_ids.tolist()
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    generated = got.token_ids[got.prompt_tokens :]
    values = logprobs.gather(1, generated.view(-1, 1))[:, 0]
    top = torch.topk(logprobs, 3, dim=-1)
    assert got.scores.tokens == generated.tolist()
    assert float((torch.tensor(got.scores.values) - values).abs().max()) <= LOGPROB_TOLERANCE
    assert float((torch.tensor(got.scores.top_values) - top.values).abs().max()) <= LOGPROB_TOLERANCE
    assert torch.equal(torch.tensor(got.scores.top_ids), top.indices)
    assert got.scores.ranks == (logprobs >= values.view(-1, 1)).sum(dim=-1).tolist()  # greedy: mostly 1
    for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}):  # sampling settings change no logprob
        req = JobRequest.model_validate({"model": "tiny", "messages": CONVERSATIONS[2], "logprobs": True, **sampling})
        got = run(served, req, max_tokens=12)
        _, logits = hooked_forward(served.hf, got.token_ids.unsqueeze(0), [])
        values, _, _ = reference_logprobs(logits, got.token_ids, first=got.prompt_tokens)
        assert float((torch.tensor(got.scores.values) - values).abs().max()) <= 1e-4, sampling


REDUCE = {
    "mean": lambda rows: rows.mean(dim=0, keepdim=True),
    "sum": lambda rows: rows.sum(dim=0, keepdim=True),
    "max": lambda rows: rows.amax(dim=0, keepdim=True),
    "last": lambda rows: rows[-1:],
}


@pytest.mark.parametrize("reduce", list(REDUCE))
@pytest.mark.parametrize(
    ("mode", "positions"), [("trace", "completion"), ("trace", "all"), ("generate", "generated"), ("generate", "all")]
)
def test_a_reduced_capture_equals_the_reduction_of_the_full_capture(served, reduce, mode, positions):
    """Generation jobs fold their rows step by step; trace jobs in one pass. Features pick columns
    (a slice, and a list in its own order) before the reduction."""
    for features, columns in (("8:40", list(range(8, 40))), ([63, 0, 17], [63, 0, 17]), (None, None)):
        capture = {"modules": POINTS, "positions": positions}
        fields = {"model": "tiny", "messages": CONVERSATIONS[1] if mode == "trace" else CONVERSATIONS[2]}
        fields |= {"mode": "trace"} if mode == "trace" else {}
        full = run(served, JobRequest.model_validate({**fields, "capture": capture}), max_tokens=9)
        reduced = run(
            served,
            JobRequest.model_validate({**fields, "capture": {**capture, "reduce": reduce, "features": features}}),
            max_tokens=9,
        )
        assert reduced.token_ids.tolist() == full.token_ids.tolist()
        for whole, one in zip(full.captured, reduced.captured, strict=True):
            rows = whole.tensor if columns is None else whole.tensor[:, columns]
            expected = REDUCE[reduce](rows)
            assert one.tensor.shape == expected.shape, (whole.point.name, features)
            assert (one.start, one.stop) == (whole.start, whole.stop)
            assert one.features == columns
            assert torch.allclose(one.tensor, expected, rtol=1e-5, atol=1e-5 * float(rows.abs().max())), (
                whole.point.name,
                reduce,
                features,
            )


def through_scheduler(served, jobs: list[tuple[JobRequest, int]]):
    """Queue every (request, max_tokens) at once on an engine thread (batches of up to 8); returns
    each job's outcome (its ended sequence, or its failure) by index, and the scheduler."""
    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        req, n = jobs[i]

        def done(outcome) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(jobs):
                finished.set()

        points = resolve(req.capture, served.info) if req.capture else []
        return Entry(seq=served.prepare(req, points, n), done=done)

    core = EngineCore(served, max_batch=8, wait_s=0.3)
    for i in range(len(jobs)):
        core.submit(entry(i))
    core.start()
    try:
        assert finished.wait(120)
    finally:
        core.stop()
    return outcomes, core


def relative(batched: torch.Tensor, alone: torch.Tensor) -> float:
    return float((batched - alone).abs().max() / alone.abs().max().clamp(min=1e-12))


def test_trace_jobs_run_together_and_each_gets_its_solo_result(served):
    """Through the engine thread: trace jobs of different lengths (similar ones left-padded in one
    pass) and a generation job queued with them; each equals its solo run."""
    capture = {"modules": POINTS, "positions": "all"}
    longer = [CONVERSATIONS[0][0], {"role": "assistant", "content": CONVERSATIONS[0][1]["content"] + " Yes."}]
    similar = [CONVERSATIONS[0], CONVERSATIONS[0], longer, CONVERSATIONS[0]]  # one pass, the shorter ones padded
    jobs = [(trace_request(m, capture, logprobs=True, top_logprobs=2), 0) for m in [*similar, *CONVERSATIONS[1:]]]
    jobs.append((JobRequest.model_validate({"model": "tiny", "messages": CONVERSATIONS[2], "capture": capture}), 6))
    outcomes, core = through_scheduler(served, jobs)
    # the four similar texts ran in one pass; the others, whose padding would pass TRACE_PADDING, alone
    assert core.stats.largest == len(similar)
    for i, (req, n) in enumerate(jobs):
        got, alone = served.finish(outcomes[i], req), run(served, req, n)
        assert got.token_ids.tolist() == alone.token_ids.tolist(), i
        for b, a in zip(got.captured, alone.captured, strict=True):
            assert b.tensor.shape == a.tensor.shape and relative(b.tensor, a.tensor) <= RELATIVE_TOLERANCE, (i, a.point)
        if alone.scores is not None:
            assert got.scores.tokens == alone.scores.tokens and got.scores.values[0] is None
            diff = (torch.tensor(got.scores.values[1:]) - torch.tensor(alone.scores.values[1:])).abs().max()
            assert float(diff) <= RELATIVE_TOLERANCE, i


def test_a_trace_pass_out_of_memory_runs_in_halves_and_a_lone_job_fails_alone(served):
    """An injected allocation failure for passes of more than two sequences: the four trace jobs
    run in halves and each still equals its solo run; then a failure for every pass: the lone
    job fails as out_of_memory and the engine goes on."""
    from shared.errors import OutOfMemory

    capture = {"modules": POINTS, "positions": "all"}
    jobs = [trace_request(m, capture, logprobs=True) for m in CONVERSATIONS]
    layer = served.hf.model.layers[1]
    forward = layer.forward
    limit = [2]

    def failing(hidden_states, *args, **kwargs):
        if hidden_states.shape[0] > limit[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return forward(hidden_states, *args, **kwargs)

    layer.forward = failing
    try:
        outcomes, _ = through_scheduler(served, [(req, 0) for req in jobs])
        limit[0] = 0
        lone, _ = through_scheduler(served, [(jobs[0], 0)])
    finally:
        layer.forward = forward
    for i, req in enumerate(jobs):
        got, alone = served.finish(outcomes[i], req), run(served, req)
        assert got.scores.tokens == alone.scores.tokens
        for b, a in zip(got.captured, alone.captured, strict=True):
            assert relative(b.tensor, a.tensor) <= RELATIVE_TOLERANCE, (i, a.point)
    assert isinstance(lone[0], OutOfMemory)


@pytest.mark.parametrize("key", ["gemma2", "mistral", "opt", "gpt2"])
def test_trace_passes_of_other_layouts_equal_their_solo_runs(key, tmp_path, smol_dir):
    """Left padding in one trace pass on sliding-window attention (Gemma 2, Mistral: windows of 8,
    shorter than these texts), OPT's flattened [B * S, H] modules and GPT-2's learned positions."""
    from tests.support.architectures import BY_KEY, available, build
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    arch = BY_KEY[key]
    if reason := available(arch):
        pytest.skip(reason)
    eng = ServedModel(
        load(Settings(model=str(build(arch, tmp_path / key, smol_dir, chat_template=True)), model_name="m"))
    )
    modules = [m.path for m in eng.info.modules if m.all_positions and m.output_dim]
    base = CONVERSATIONS[0]
    texts = [base, [base[0], {"role": "assistant", "content": base[1]["content"] + " Yes."}]]
    jobs = [
        (JobRequest.model_validate({"model": "m", "mode": "trace", "messages": m, "logprobs": True,
                                    "capture": {"modules": modules, "positions": "all"}}), 0)
        for m in texts
    ]  # fmt: skip
    outcomes, core = through_scheduler(eng, jobs)
    assert core.stats.largest == 2  # one left-padded pass
    lengths = set()
    for i, (req, _) in enumerate(jobs):
        got, alone = eng.finish(outcomes[i], req), run(eng, req)
        lengths.add(len(alone.token_ids))
        assert got.token_ids.tolist() == alone.token_ids.tolist()
        for b, a in zip(got.captured, alone.captured, strict=True):
            assert relative(b.tensor, a.tensor) <= RELATIVE_TOLERANCE, (key, i, a.point.name)
        diff = (torch.tensor(got.scores.values[1:]) - torch.tensor(alone.scores.values[1:])).abs().max()
        assert float(diff) <= RELATIVE_TOLERANCE, (key, i)
    assert len(lengths) == 2  # the shorter text was padded


@pytest.mark.parametrize("chunk", [5, 16])
def test_a_trace_fed_in_chunks_equals_one_plain_forward_pass(served, chunk):
    """A long trace runs in chunks between decoding steps (Decoder.feed): every position's
    activations, the vocabulary projection at the completion's positions, and the
    log-probabilities equal the reference's plain `model(input_ids)` within float rounding
    (attention over a cache adds in another order), and the positions line up across chunks."""
    from worker.batch.sequence import Feeding

    messages = CONVERSATIONS[1]
    jobs = [
        trace_request(messages, {"modules": POINTS, "positions": "all"}, logprobs=True, top_logprobs=3),
        trace_request(messages, {"modules": ["lm_head", "model.layers.1"], "positions": "completion"}),
    ]
    ids = template(served, messages, generation_prompt=False)
    modules = [p.module for p in resolve(jobs[0].capture, served.info)] + ["lm_head", "model.layers.1"]
    rows, logits = hooked_forward(served.hf, torch.tensor([ids]), modules)
    for req in jobs:
        seq = served.prepare(req, resolve(req.capture, served.info), 0)
        chunks = 0
        with torch.inference_mode():
            decoder = served.decoder()
            try:
                item = Feeding(seq)
                while not decoder.feed(item, chunk):
                    chunks += 1
            finally:
                decoder.close()
        assert chunks == (len(ids) - 1) // chunk and seq.ended == "trace"
        got = served.finish(seq, req)
        for captured in got.captured:
            want = rows[captured.point.module][captured.start : captured.stop]
            assert captured.tensor.shape == want.shape, captured.point.name
            assert relative(captured.tensor, want) <= RELATIVE_TOLERANCE, captured.point.name
        if req.logprobs:
            values, top_values, top_ids = reference_logprobs(logits, torch.tensor(ids), first=1, k=3)
            assert got.scores.tokens == ids and got.scores.values[0] is None
            assert torch.allclose(torch.tensor(got.scores.values[1:]), values, atol=1e-4, rtol=0)
            assert torch.allclose(torch.tensor(got.scores.top_values[1:]), top_values, atol=1e-4, rtol=0)
            assert torch.equal(torch.tensor(got.scores.top_ids[1:]), top_ids)
        else:
            assert {c.point.module for c in got.captured} == {"lm_head", "model.layers.1"}
            assert all((c.start, c.stop) == got.completion for c in got.captured)

"""Interventions in the engine, against the independent reference (tests/support/edit_reference.py:
forward hooks that edit a plain Hugging Face generate): the same tokens and, at batch 1, the same
captured values; in a batch, each job as alone. Per-step application counts are checked by
counting what the selection and the gate imply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.capture_spec import resolve
from shared.intervention_check import resolve as resolve_edits
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.support import edit_reference as ref
from tests.support.architectures import BY_KEY, available, build
from tests.worker.test_batching import RELATIVE_TOLERANCE, assert_same

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Name three colours."}]
OTHER = [{"role": "user", "content": "What is 2+3? Answer in one word, then explain."}]


def load_engine(folder):
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(folder), model_name="m")))


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


class Stored:
    """Stands in for the store behind a job's references (tests/e2e read real ones): the values a
    `patch` or a job vector names, handed over as the store would."""

    def __init__(self, first: int = 0, rows: np.ndarray | None = None, vector: np.ndarray | None = None) -> None:
        self.first, self.rows, self.value = first, rows, vector

    def patch(self, source, module, hook, width, where):
        return self.first, self.rows

    def vector(self, named, width, where):
        return self.value


def request(messages, edits, capture=None, **fields) -> JobRequest:
    body = {"model": "m", "messages": messages, "interventions": edits, "capture": capture, **fields}
    return JobRequest.model_validate(body)


def run(served, req: JobRequest, max_tokens: int, refs=None):
    points = resolve(req.capture, served.info) if req.capture else []
    edits = resolve_edits(req.interventions, served.info, req.trace, max_tokens) if req.interventions else []
    return served.run(req, points, max_tokens, edit_points=edits, references=refs)


def vector(width: int, seed: int, scale: float = 1.0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(width, generator=g) * scale).tolist()


def selected(positions: str | dict, prompt: int, new: int) -> set[int]:
    from shared.interventions import EditPositions, intervals

    spec = positions if isinstance(positions, str) else EditPositions.model_validate(positions)
    return {p for lo, hi in intervals(spec, prompt, new) for p in range(lo, hi)}


def compare(served, req, max_tokens, ref_edits, capture_paths, refs=None):
    """The job against the reference: identical tokens, captured values equal within 1e-5 of
    their scale; returns the generation."""
    got = run(served, req, max_tokens, refs)
    messages = [m.model_dump() for m in req.messages or []]
    ids, rows, prompt = ref.edited_generate(served.hf, served.tokenizer, messages, max_tokens, ref_edits, capture_paths)
    assert got.token_ids.tolist() == ids.tolist()
    for tensor in got.captured:
        want = rows[tensor.point.module]
        scale = float(want.abs().max())
        diff = float((tensor.tensor.float() - want).abs().max())
        assert diff <= 1e-5 * scale, (tensor.point.name, diff, scale)
    return got, prompt


def reference_edit(edit: dict, v: torch.Tensor, chosen: set[int]) -> ref.Edit:
    if edit["op"] == "add":
        return ref.add(v, edit.get("coeff", 1.0), chosen, edit.get("normalize", False))
    if edit["op"] == "scale":
        return ref.scale(edit["factor"], list(range(0, 16)), chosen)
    if edit["op"] == "zero":
        return ref.zero(edit["features"], chosen)
    return ref.project_out(v, edit.get("value", 0.0), chosen)


def test_every_operation_equals_the_hand_written_reference(served):
    """add (plain and normalized), scale, zero, project_out and a gate, at outputs and an input,
    at prompt positions and generated steps; captures on the edited module see edited values."""
    width = served.info.hidden_size
    capture = {"modules": ["model.layers.1", "model.layers.2", "model.norm"], "positions": "all"}
    cases = [
        ({"module": "model.layers.1", "op": "add", "vector": vector(width, 1), "coeff": 3.0}, "all"),
        (
            {
                "module": "model.layers.1",
                "op": "add",
                "vector": vector(width, 2),
                "coeff": 0.5,
                "normalize": True,
                "positions": "generated",
            },
            "generated",
        ),
        (
            {
                "module": "model.layers.2",
                "op": "scale",
                "factor": -1.5,
                "features": "0:16",
                "positions": {"prompt": [-3, "2:5"], "generated": ":3"},
            },
            {"prompt": [-3, "2:5"], "generated": ":3"},
        ),
        ({"module": "model.layers.1", "op": "zero", "features": [0, 5, 9], "positions": "prompt"}, "prompt"),
        ({"module": "model.layers.2", "op": "project_out", "vector": vector(width, 3), "value": 2.0}, "all"),
        (
            {"module": "model.layers.1.mlp", "hook": "input", "op": "add", "vector": vector(width, 4), "coeff": 2.0},
            "all",
        ),
    ]
    for edit, positions in cases:
        req = request(MESSAGES, [edit], capture)
        plain = run(served, request(MESSAGES, None, capture), 8)
        prompt = plain.prompt_tokens
        chosen = selected(positions, prompt, 8)
        v = torch.tensor(edit.get("vector", [0.0] * width))
        fn = reference_edit(edit, v, chosen)
        got, _ = compare(served, req, 8, [(edit["module"], edit.get("hook", "output"), fn)], capture["modules"])
        changed = any(not torch.equal(a.tensor, b.tensor) for a, b in zip(got.captured, plain.captured, strict=True))
        assert changed, f"{edit['op']} changed nothing"
        report = got.interventions[0]
        steps = got.completion_tokens
        expect = [len([p for p in chosen if p < prompt])] + [
            1 if prompt - 1 + k in chosen else 0 for k in range(1, steps)
        ]
        assert report.applied == expect and report.total == sum(expect), (edit["op"], report.applied, expect)


def test_a_gated_edit_fires_where_the_probe_says_and_counts_it(served):
    width = served.info.hidden_size
    probe = vector(width, 5)
    steer = vector(width, 6, 0.5)
    edit = {
        "module": "model.layers.2",
        "op": "add",
        "vector": steer,
        "coeff": 2.0,
        "when": {"probe": probe, "bias": 0.1, "above": 0.0},
    }
    capture = {"modules": ["model.layers.2", "model.norm"], "positions": "all"}
    req = request(MESSAGES, [edit], capture)
    inner = ref.add(torch.tensor(steer), 2.0, set(range(10_000)))
    fn = ref.gated(inner, torch.tensor(probe), 0.1, 0.0, None)
    got, prompt = compare(served, req, 10, [("model.layers.2", "output", fn)], capture["modules"])
    # The count per step is the positions whose incoming value scored above 0: read from an
    # unedited capture of the module's output taken at its pre-edit value (a capture at the
    # block's output with the edit elsewhere would differ), so count from the reference hooks.
    scores: list[int] = []
    seen: list[torch.Tensor] = []

    def watch(value, positions):
        seen.append(((value @ torch.tensor(probe)) + 0.1 > 0).sum())
        return fn(value, positions)

    ref.edited_generate(served.hf, served.tokenizer, MESSAGES, 10, [("model.layers.2", "output", watch)], [])
    scores = [int(s) for s in seen][: got.completion_tokens]
    assert got.interventions[0].applied == scores
    assert 0 < sum(scores) < prompt + got.completion_tokens - 1  # it fired at some positions, not all


def test_edits_in_request_order_on_one_module(served):
    width = served.info.hidden_size
    a, d = vector(width, 7), vector(width, 8)
    edits = [
        {"module": "model.layers.1", "op": "add", "vector": a, "coeff": 4.0},
        {"module": "model.layers.1", "op": "project_out", "vector": d},
    ]
    capture = {"modules": ["model.layers.1"], "positions": "all"}
    chosen = set(range(10_000))
    reference = [
        ("model.layers.1", "output", ref.add(torch.tensor(a), 4.0, chosen)),
        ("model.layers.1", "output", ref.project_out(torch.tensor(d), 0.0, chosen)),
    ]
    got, _ = compare(served, request(MESSAGES, edits, capture), 6, reference, capture["modules"])
    direction = torch.tensor(d) / torch.tensor(d).norm()
    along = got.captured[0].tensor @ direction
    assert float(along.abs().max()) < 1e-4 * float(got.captured[0].tensor.abs().max())  # projected out last


def test_a_patch_copies_the_source_rows_at_its_positions(served):
    """Rows captured from another prompt (of the same length here) replace this job's values at
    the patched positions; positions outside the source's rows fail the job with what to do."""
    capture = {"modules": ["model.layers.1"], "positions": "all"}
    source = run(served, request(OTHER, None, capture), 4)
    rows = source.captured[0].tensor.numpy()
    prompt = run(served, request(MESSAGES, None, None), 1).prompt_tokens
    edit = {
        "module": "model.layers.1",
        "op": "patch",
        "source": {"job": "0" * 8 + "-0000-4000-8000-" + "0" * 12, "tensor": "model.layers.1"},
        "positions": {"prompt": ["-2:"]},
    }
    chosen = selected({"prompt": ["-2:"]}, prompt, 6)
    assert max(chosen) < rows.shape[0]
    fn = ref.patch(torch.from_numpy(rows), 0, chosen)
    got, _ = compare(
        served,
        request(MESSAGES, [edit], capture),
        6,
        [("model.layers.1", "output", fn)],
        ["model.layers.1"],
        refs=Stored(0, rows),
    )
    assert got.interventions[0].applied[0] == 2
    far = {**edit, "positions": "all"}
    with pytest.raises(Exception, match="source job's rows cover positions 0 to"):
        run(served, request(MESSAGES, [far], None), 40, Stored(0, rows[:3]))


def test_a_patch_of_prompt_positions_leaves_the_decoding_steps_to_the_tables(served, monkeypatch):
    """A patch applies at prompt positions only, so no decoding step has it: the steps run from the
    edit tables (replayable), none with the eager hooks, and the job equals the reference hooks'
    run. A patch that reaches a decoding position cannot be in the tables."""
    from worker.batch.slot_decoding import SlotDecoder
    from worker.hooks.edits import JobEdits, RowEdit
    from worker.hooks.step_edits import fits

    plans: list[object] = []
    eager = SlotDecoder._eager

    def spy(self, lo, hi, owners, constrained, features, keys, plan, top, **kwargs):
        plans.append(plan)
        return eager(self, lo, hi, owners, constrained, features, keys, plan, top, **kwargs)

    monkeypatch.setattr(SlotDecoder, "_eager", spy)
    width = served.info.hidden_size
    capture = {"modules": ["model.layers.1"], "positions": "all"}
    source = run(served, request(OTHER, None, capture), 4)
    rows = source.captured[0].tensor.numpy()
    prompt = run(served, request(MESSAGES, None, None), 1).prompt_tokens
    plans.clear()
    patch = {
        "module": "model.layers.1",
        "op": "patch",
        "source": {"job": "0" * 8 + "-0000-4000-8000-" + "0" * 12, "tensor": "model.layers.1"},
        "positions": {"prompt": ["-2:"]},
    }
    steer = {"module": "model.layers.2", "op": "add", "vector": vector(width, 30), "coeff": 2.0}
    chosen = selected({"prompt": ["-2:"]}, prompt, 6)
    refs = [
        ("model.layers.1", "output", ref.patch(torch.from_numpy(rows), 0, chosen)),
        ("model.layers.2", "output", ref.add(torch.tensor(steer["vector"]), 2.0, set(range(10_000)))),
    ]
    got, _ = compare(served, request(MESSAGES, [patch, steer], capture), 6, refs, ["model.layers.1"], Stored(0, rows))
    assert got.interventions[0].applied[0] == 2 and sum(got.interventions[0].applied[1:]) == 0
    assert len(plans) == 5 and all(plan for plan in plans), plans  # 5 decoding steps, each from the tables
    unit = torch.zeros(width)
    reaching = RowEdit(0, "model.layers.1", "output", "patch", [(prompt - 2, prompt + 1)], patch_rows=unit[None])
    assert fits(JobEdits([RowEdit(0, "model.layers.1", "output", "patch", [(prompt - 2, prompt)])], prompt))
    assert not fits(JobEdits([reaching], prompt))


def run_edit_batch(served, questions, edit_sets, capture):
    """Each (question, edits) as a job of 10 tokens, joining at steps 0, 0, 2, 3, 3 of one batch
    (tests/worker/test_batching.py's run_batched, its jobs prepared with their edits): the jobs,
    their results and the largest batch."""
    import tests.worker.test_batching as tb

    jobs = [(request(q, e, capture), 10) for q, e in zip(questions, edit_sets, strict=True)]

    def prepare_with_edits(eng, req, n, w=None):
        points = resolve(req.capture, served.info)
        edits = resolve_edits(req.interventions, served.info, False, n) if req.interventions else []
        return served.prepare(req, points, n, None, edits)

    original = tb.prepare
    tb.prepare = prepare_with_edits
    try:
        batched, largest = tb.run_batched(served, jobs, join_at=[0, 0, 2, 3, 3])
    finally:
        tb.prepare = original
    return jobs, batched, largest


def test_a_batch_mixing_steered_gated_and_plain_jobs_gives_each_its_solo_result(served):

    width = served.info.hidden_size
    capture = {"modules": ["model.layers.{1,2}", "model.norm"], "positions": "all"}
    questions = [MESSAGES, OTHER, [{"role": "user", "content": "Count to five."}], MESSAGES, OTHER]
    edit_sets = [
        [{"module": "model.layers.1", "op": "add", "vector": vector(width, 10), "coeff": 3.0}],
        None,
        [
            {
                "module": "model.layers.2",
                "op": "add",
                "vector": vector(width, 11),
                "coeff": 1.0,
                "when": {"probe": vector(width, 12), "above": 0.0},
            },
            {"module": "model.layers.1", "op": "scale", "factor": 0.5, "positions": "generated"},
        ],
        [
            {
                "module": "model.layers.1",
                "op": "add",
                "vector": vector(width, 13),
                "coeff": -2.0,
                "positions": {"generated": ["2:5"]},
            }
        ],
        [{"module": "model.layers.2", "op": "zero", "features": "0:32"}],
    ]
    jobs, batched, largest = run_edit_batch(served, questions, edit_sets, capture)
    assert largest >= 4
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        alone = run(served, req, n)
        assert_same(got, alone, f"job {i}")
        assert (got.interventions is None) == (alone.interventions is None)
        if got.interventions is not None:
            assert [r.applied for r in got.interventions] == [r.applied for r in alone.interventions], i
    assert RELATIVE_TOLERANCE <= 1e-4


def test_a_batch_of_table_edits_gives_each_job_its_solo_result(served, monkeypatch):
    """Edits that fit the slots' edit tables (worker/hooks/step_edits.py: every op but patch, ungated),
    jobs joining at different steps: the decoding steps apply them from the tables (seen), and
    each job gets its solo result and counts."""
    from worker.hooks.step_edits import StepEdits

    plans: list[frozenset] = []
    recording = StepEdits.recording

    def spy(self, plan, lo, rows):
        plans.append(plan)
        return recording(self, plan, lo, rows)

    monkeypatch.setattr(StepEdits, "recording", spy)
    width = served.info.hidden_size
    capture = {"modules": ["model.layers.{1,2}", "model.norm"], "positions": "all"}
    questions = [MESSAGES, OTHER, [{"role": "user", "content": "Count to five."}], MESSAGES, OTHER]
    edit_sets = [
        [{"module": "model.layers.1", "op": "add", "vector": vector(width, 20), "coeff": 3.0}],
        None,
        [
            {"module": "model.layers.2", "op": "project_out", "vector": vector(width, 21), "value": 1.0},
            {"module": "model.layers.1", "op": "scale", "factor": 0.5, "features": "0:16", "positions": "generated"},
            {"module": "model.layers.1", "op": "zero", "features": [1, 2], "positions": {"generated": ["1:3", 6]}},
        ],
        [
            {
                "module": "model.layers.1",
                "op": "add",
                "vector": vector(width, 22),
                "coeff": -2.0,
                "normalize": True,
                "positions": {"generated": ["2:5"]},
            },
            {"module": "model.layers.1.mlp", "hook": "input", "op": "add", "vector": vector(width, 23)},
        ],
        [{"module": "model.layers.2", "op": "zero", "features": "0:32"}],
    ]
    jobs, batched, largest = run_edit_batch(served, questions, edit_sets, capture)
    assert largest >= 4
    assert {kind for plan in plans for _, _, kind in plan} == {1, 2, 3, 4, 5}, plans
    monkeypatch.undo()
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        alone = run(served, req, n)
        assert_same(got, alone, f"job {i}")
        if got.interventions is not None:
            assert [r.applied for r in got.interventions] == [r.applied for r in alone.interventions], i


def test_a_trace_job_edits_its_one_pass(served):
    width = served.info.hidden_size
    v = vector(width, 14)
    messages = [*MESSAGES, {"role": "assistant", "content": "Red, green and blue."}]
    req = JobRequest.model_validate(
        {
            "model": "m",
            "mode": "trace",
            "messages": messages,
            "capture": {"modules": ["model.norm"], "positions": "all"},
            "interventions": [
                {"module": "model.layers.1", "op": "add", "vector": v, "coeff": 2.0, "positions": {"prompt": ["-4:"]}}
            ],
        }
    )
    got = run(served, req, 0)
    ids = got.token_ids.unsqueeze(0)
    p = ids.shape[1]
    chosen = set(range(p - 4, p))
    kept = {}

    def edit_hook(_m, _a, output):
        value = output[0] if isinstance(output, tuple) else output
        edited = value.clone()
        for s in chosen:
            edited[0, s] = value[0, s] + 2.0 * torch.tensor(v)
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    def keep(_m, _a, output):
        kept["norm"] = (output[0] if isinstance(output, tuple) else output)[0].clone()

    handles = [
        served.hf.get_submodule("model.layers.1").register_forward_hook(edit_hook),
        served.hf.get_submodule("model.norm").register_forward_hook(keep),
    ]
    try:
        with torch.inference_mode():
            served.hf(ids)
    finally:
        for h in handles:
            h.remove()
    assert torch.allclose(got.captured[0].tensor, kept["norm"], rtol=0, atol=1e-5 * float(kept["norm"].abs().max()))
    assert got.interventions[0].applied == [4]


def every_operation(eng, max_tokens: int = 6) -> None:
    """add, normalized add, scale, zero, project_out, patch and a gated add at a middle block of
    the residual stream, each against the hand-written reference (tokens and captured values)."""
    presets = eng.info.presets["residual"]
    block, last = presets[len(presets) // 2], presets[-1]
    width = eng.info.hidden_size
    capture = {"modules": list(dict.fromkeys([block, last])), "positions": "all"}
    plain = run(eng, request(MESSAGES, None, {"modules": [block], "positions": "all"}), max_tokens)
    prompt = plain.prompt_tokens
    rows = plain.captured[0].tensor
    v = vector(width, 20)
    scale = float(rows.abs().mean())  # vectors about as large as the block's values
    v_scaled = (torch.tensor(v) * scale).tolist()
    every = selected("all", prompt, max_tokens)
    generated = selected("generated", prompt, max_tokens)
    last_prompt = selected({"prompt": ["-3:"]}, prompt, max_tokens)
    probe = vector(width, 21)
    source = {"job": "0" * 8 + "-0000-4000-8000-" + "0" * 12, "tensor": block}
    cases = [
        ({"op": "add", "vector": v_scaled, "coeff": 2.0}, ref.add(torch.tensor(v_scaled), 2.0, every)),
        (
            {"op": "add", "vector": v, "coeff": 0.5, "normalize": True, "positions": "generated"},
            ref.add(torch.tensor(v), 0.5, generated, normalize=True),
        ),
        ({"op": "scale", "factor": 3.0, "features": "0:16"}, ref.scale(3.0, list(range(16)), every)),
        ({"op": "zero", "features": [1, 2, 3], "positions": "generated"}, ref.zero([1, 2, 3], generated)),
        ({"op": "project_out", "vector": v, "value": 1.0}, ref.project_out(torch.tensor(v), 1.0, every)),
        (
            {"op": "patch", "source": source, "positions": {"prompt": ["-3:"]}},
            ref.patch(torch.flip(rows, [0]), 0, last_prompt),
        ),
        (
            {"op": "add", "vector": v_scaled, "coeff": 2.0, "when": {"probe": probe, "above": 0.0}},
            ref.gated(ref.add(torch.tensor(v_scaled), 2.0, every), torch.tensor(probe), 0.0, 0.0, None),
        ),
    ]
    refs = Stored(0, torch.flip(rows, [0]).numpy())  # another prompt's rows, as far as the edit can tell
    for fields, reference in cases:
        edit = {"module": block, **fields}
        got, _ = compare(
            eng,
            request(MESSAGES, [edit], capture),
            max_tokens,
            [(block, "output", reference)],
            capture["modules"],
            refs=refs,
        )
        assert got.interventions[0].total > 0, fields["op"]


@pytest.mark.parametrize("key", ["gpt2", "gemma2"])
def test_other_architectures_edit_as_the_reference(key, tmp_path, smol_dir):
    """GPT-2 (learned positions, tuple outputs) and Gemma 2 (sliding windows, its own norms)."""
    arch = BY_KEY[key]
    if reason := available(arch):
        pytest.skip(reason)
    every_operation(load_engine(build(arch, tmp_path / key, smol_dir, chat_template=True)))


def test_the_tiny_llama_edits_as_the_reference(served):
    every_operation(served)


def test_smollm2_edits_as_the_reference(smol_dir):
    """The built-in model: every operation at layer 15; then a steering vector at three layers
    changes its answer, exactly as the reference's does."""
    eng = load_engine(smol_dir)
    every_operation(eng, max_tokens=5)
    width = eng.info.hidden_size
    v = vector(width, 30, 0.2)
    edits = [{"preset": "residual", "layers": [3, 10, 20], "op": "add", "vector": v, "coeff": 8.0}]
    capture = {"modules": ["model.layers.20", "model.norm"], "positions": "generated"}
    req = request(MESSAGES, edits, capture)
    got = run(eng, req, 8)
    chosen = set(range(10_000))
    paths = [eng.info.presets["residual"][i] for i in (3, 10, 20)]
    ids, rows, prompt = ref.edited_generate(
        eng.hf,
        eng.tokenizer,
        MESSAGES,
        8,
        [(p, "output", ref.add(torch.tensor(v), 8.0, chosen)) for p in paths],
        ["model.layers.20", "model.norm"],
    )
    assert got.token_ids.tolist() == ids.tolist()
    for tensor in got.captured:
        want = rows[tensor.point.module][prompt - 1 :]
        scale = float(want.abs().max())
        assert float((tensor.tensor - want).abs().max()) <= 1e-5 * scale
    plain = run(eng, request(MESSAGES, None, None), 8)
    assert plain.text != got.text  # the steering vector is strong enough to change the answer


def test_a_pass_that_runs_out_of_memory_and_runs_again_counts_its_edits_once(served):
    """An injected allocation failure inside every pass of more than 2 rows (after layer 0 ran and
    its edits were applied): the step runs again in halves, and every job's tokens, captures and
    per-step counts equal its solo run (a failed pass's counts are never kept)."""
    import tests.worker.test_batching as tb

    width = served.info.hidden_size
    capture = {"modules": ["model.layers.{0,2}"], "positions": "all"}
    questions = [MESSAGES, OTHER, [{"role": "user", "content": "Count to five."}], MESSAGES]
    edit_sets = [
        [{"module": "model.layers.0", "op": "add", "vector": vector(width, 40), "coeff": 2.0}],
        [
            {
                "module": "model.layers.2",
                "op": "add",
                "vector": vector(width, 41),
                "when": {"probe": vector(width, 42), "above": 0.0},
            }
        ],
        None,
        [{"module": "model.layers.0", "op": "scale", "factor": 0.5, "positions": "generated"}],
    ]
    jobs = [(request(q, e, capture), 8) for q, e in zip(questions, edit_sets, strict=True)]

    def prepare_with_edits(eng, req, n, w=None):
        edits = resolve_edits(req.interventions, eng.info, False, n) if req.interventions else []
        return eng.prepare(req, resolve(req.capture, eng.info), n, None, edits)

    inject = tb.FailAbove(2)
    original = tb.prepare
    tb.prepare = prepare_with_edits
    try:
        batched, largest = tb.run_batched(served, jobs, join_at=[0, 0, 0, 2], wrap=inject)
    finally:
        tb.prepare = original
        inject.undo()
    assert inject.decoder.most_rows is not None and inject.decoder.most_rows <= 2 and largest >= 3
    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        alone = run(served, req, n)
        assert_same(got, alone, f"job {i}")
        if alone.interventions is not None:
            assert [r.applied for r in got.interventions] == [r.applied for r in alone.interventions], i


def test_prompts_fed_in_chunks_take_their_edits_at_the_right_positions(served):
    """Through the engine thread with chunks shorter than the prompts: edits at prompt windows
    that straddle chunk boundaries, a gate, and generated steps; every job equals its solo run
    (tokens, captures, per-step counts)."""
    import threading

    from worker.engine.core import EngineCore
    from worker.engine.scheduler import Entry

    width = served.info.hidden_size
    capture = {"modules": ["model.layers.{1,2}"], "positions": "all"}
    long_question = [
        {"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then half as many."}
    ]
    edit_sets = [
        None,
        [
            {
                "module": "model.layers.1",
                "op": "add",
                "vector": vector(width, 50),
                "coeff": 2.0,
                "positions": {"prompt": ["5:17"]},
            }
        ],
        [
            {
                "module": "model.layers.2",
                "op": "scale",
                "factor": 0.5,
                "positions": {"prompt": [-1, 3], "generated": ":2"},
            },
            {
                "module": "model.layers.1",
                "op": "add",
                "vector": vector(width, 51),
                "when": {"probe": vector(width, 52), "above": 0.0},
            },
        ],
    ]
    questions = [MESSAGES, long_question, long_question]
    jobs = [(request(q, e, capture), 8) for q, e in zip(questions, edit_sets, strict=True)]
    outcomes: dict[int, object] = {}
    finished = threading.Event()

    def entry(i: int) -> Entry:
        req, n = jobs[i]
        edits = resolve_edits(req.interventions, served.info, False, n) if req.interventions else []

        def done(outcome) -> None:
            outcomes[i] = outcome
            if len(outcomes) == len(jobs):
                finished.set()

        return Entry(seq=served.prepare(req, resolve(req.capture, served.info), n, None, edits), done=done)

    entries = [entry(i) for i in range(len(jobs))]
    chunk = 7
    assert all(e.seq.prompt_tokens > 2 * chunk for e in entries[1:])
    core = EngineCore(served, max_batch=4, wait_s=0.0, chunk_tokens=chunk)
    core.submit(entries[0])
    core.start()
    try:
        for e in entries[1:]:
            core.submit(e)
        assert finished.wait(120)
    finally:
        core.stop()
    for i, (req, n) in enumerate(jobs):
        got, alone = served.finish(outcomes[i], req), run(served, req, n)
        assert_same(got, alone, f"job {i}")
        if alone.interventions is not None:
            assert [r.applied for r in got.interventions] == [r.applied for r in alone.interventions], i


@pytest.mark.parametrize("path", ["tables", "hooks", "compacted"])
def test_a_plain_job_in_the_place_a_steered_job_left_is_not_steered(served, monkeypatch, path):
    """Two steered jobs run; the short one ends and is freed; a plain job then takes its place
    beside the long one (the same decoder). The plain job gets its solo tokens and captures, and
    the long one its own, whichever way the steps apply edits: the slots' edit tables, the edit
    hooks (edits the tables cannot hold), or the compacted decoder's hooks. (A slot's edit table
    row was once kept for the next job: the slot remembered its job by a weak reference, and a
    freed job's dead reference was taken for "no edits", so the plain job was steered. That failed
    `tables`; the hooks, remembered the same way, are rebuilt by the joining job's prefill.)"""
    import gc

    import worker.batch.slot_decoding
    from worker.batch.decoding import Decoder

    if path == "hooks":
        monkeypatch.setattr(worker.batch.slot_decoding, "fits", lambda edits: False)
    width = served.info.hidden_size
    capture = {"modules": ["model.layers.{1,2}"], "positions": "all"}
    steer = [{"module": "model.layers.1", "op": "add", "vector": vector(width, 31), "coeff": 6.0}]
    long = request(MESSAGES, [{**steer[0], "coeff": -4.0}], capture)
    short = request(OTHER, steer)
    plain = request(MESSAGES, None, capture)
    alone = [run(served, long, 14), run(served, plain, 8)]

    def prepare(req: JobRequest, max_tokens: int):
        edits = resolve_edits(req.interventions, served.info, False, max_tokens) if req.interventions else []
        points = resolve(req.capture, served.info) if req.capture else []
        return served.prepare(req, points, max_tokens, None, edits)

    with torch.inference_mode():
        if path == "compacted":
            decoder = Decoder(served.hf, served.tokenizer, served._pad()["pad_token_id"])
        else:
            decoder = served.decoder()
        try:
            first, second = prepare(short, 3), prepare(long, 14)
            decoder.admit(first)
            decoder.admit(second)
            while first.ended is None:
                decoder.step()
            assert first.failure is None and second.ended is None
            del first
            gc.collect()
            third = prepare(plain, 8)
            decoder.admit(third)
            while decoder.rows:
                decoder.step()
        finally:
            decoder.close()
    assert_same(served.finish(second, long), alone[0], f"{path}: the long steered job")
    assert_same(served.finish(third, plain), alone[1], f"{path}: the plain job")

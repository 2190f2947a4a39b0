"""The decoding step replayed as CUDA graphs (worker/model/runner.py) against the same engine run
eagerly (ACTQ_CUDA_GRAPHS off), on the tiny random Llama, in float32 and bfloat16:

- greedy and seeded sampled jobs, joining at different steps and leaving at others, give the
  eager run's tokens (with graphs each step is launched before the last one's tokens are read,
  worker/batch/slot_decoding.py's overlap; the eager run waits for every step's tokens): identical in
  float32; in bfloat16 the graph runs the bucket's padded shapes (more rows, a longer masked span)
  whose kernels can round differently, so tokens may part only at a near tie (the check of
  tests/gpu/test_gpu_engine.py, same tolerance);
- every rows bucket (1, 2, 4, 8) is replayed, and a row's tokens do not depend on its bucket or
  slot: each job batched equals the same job alone (bucket 1, slot 0);
- jobs that capture ride in the replayed step (worker/hooks/step_capture.py: the rings written inside
  the graph) beside jobs that do not: their solo eager runs equal forward hooks on the plain model
  bit for bit, and their replayed rows are within the tolerance above of those.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_engine import (
    DEVICE,
    TOLERANCE,
    assert_close_to_solo,
    assert_equals_forward_hooks,
    load_engine,
    plain_model,
)
from tests.worker.test_batching import CAPTURE, QUESTIONS, job, run_batched, solo

GREEDY = [(QUESTIONS[i], 6 + 3 * i, {}) for i in range(6)]
SAMPLED = [(QUESTIONS[i], 12, {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}) for i in range(4)]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engines(tiny_dir, dtype):
    from worker.batch.served import ServedModel

    graphs = load_engine(tiny_dir, device=DEVICE, dtype=dtype)
    eager = ServedModel(graphs.loaded, cuda_graphs=False)  # the same weights
    assert "CUDA graphs" in graphs.describe_decoder() and "eagerly" in eager.describe_decoder()
    return graphs, eager


def requests(specs):
    return [job(question, n, None, **fields) for question, n, fields in specs]


def graph_keys(recorded: list[tuple]):
    """A `run_batched` wrap that adds to `recorded` the keys of the graphs its decoder recorded,
    read as the decoder closes."""

    def keep_keys(decoder) -> None:
        close = decoder.close

        def closing() -> None:
            recorded.extend(decoder.runner._graphs)
            close()

        decoder.close = closing

    return keep_keys


@pytest.mark.parametrize("specs", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_graph_replay_gives_the_eager_tokens(engines, dtype, specs):
    graphs, eager = engines
    jobs = requests(specs)
    join_at = [0, 0, 2, 3, 5, 8][: len(jobs)]
    replayed, largest = run_batched(graphs, jobs, join_at=join_at)
    eagerly, _ = run_batched(eager, jobs, join_at=join_at)
    assert largest >= 3
    for index, (got, want) in enumerate(zip(replayed, eagerly, strict=True)):
        if dtype == "float32":
            assert torch.equal(got.token_ids, want.token_ids), index
        else:
            assert_close_to_solo(
                got,
                want,
                None if torch.equal(got.token_ids, want.token_ids) else _logits(eager, jobs[index]),
                TOLERANCE[dtype],
                str(index),
            )


def _logits(served, request_and_tokens):
    """The eager run's logits of each new token (for a near-tie check), from a forward pass over
    its prompt and completion."""
    request, n = request_and_tokens
    alone = solo(served, request, n)
    with torch.inference_mode():
        out = served.hf(alone.token_ids.unsqueeze(0).to(DEVICE))
    return out.logits[0, alone.prompt_tokens - 1 : -1].float().cpu()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_every_bucket_replays_each_rows_own_result(engines, dtype, rows):
    graphs, _ = engines
    specs = [GREEDY[i % len(GREEDY)] for i in range(rows)]
    jobs = requests(specs)
    batched, largest = run_batched(graphs, jobs, join_at=[0] * rows)
    assert largest == rows
    for index, ((request, n), got) in enumerate(zip(jobs, batched, strict=True)):
        alone = solo(graphs, request, n)
        if dtype == "float32":
            assert torch.equal(got.token_ids, alone.token_ids), (rows, index)
        else:
            assert_close_to_solo(
                got,
                alone,
                None if torch.equal(got.token_ids, alone.token_ids) else _logits(graphs, (request, n)),
                TOLERANCE[dtype],
                str(index),
            )


def test_capturing_jobs_beside_replayed_batches_equal_forward_hooks(engines, dtype, tiny_dir):
    graphs, eager = engines
    reference = plain_model(tiny_dir, dtype)
    plain = requests(GREEDY[:3])
    capturing = [job(QUESTIONS[4], 8, CAPTURE), job(QUESTIONS[5], 6, {**CAPTURE, "positions": "generated"})]
    recorded: list[tuple] = []

    keep_keys = graph_keys(recorded)
    batched, _ = run_batched(graphs, plain + capturing, join_at=[0, 0, 1, 4, 6], wrap=keep_keys)
    assert any(key[4] for key in recorded), f"no graph recorded a capture: {recorded}"
    for (request, n), got in zip(capturing, batched[3:], strict=True):
        alone = solo(eager, request, n)
        positions = request.capture.positions
        assert_equals_forward_hooks(alone, request.messages[0].content, n, positions, reference)
        assert_close_to_solo(got, alone, None, TOLERANCE[dtype], positions)


def test_editing_jobs_ride_in_the_replayed_step_and_give_the_eager_results(engines, dtype):
    """Jobs whose edits fit the edit tables (worker/hooks/step_edits.py) beside plain jobs: the graphs
    recorded hold edit ops, and each job's tokens are the eager run's (float32: identical;
    bfloat16: parting only at a near tie)."""
    from shared.intervention_check import resolve as resolve_edits
    from shared.schemas import JobRequest

    graphs, eager = engines
    width = graphs.info.hidden_size
    generator = torch.Generator().manual_seed(5)
    edits = [
        [{"module": "model.layers.1", "op": "add", "vector": torch.randn(width, generator=generator).tolist()}],
        None,
        [{"module": "model.layers.2", "op": "scale", "factor": 0.5, "positions": "generated"}],
        [{"module": "model.layers.1", "op": "zero", "features": "0:8"}],
    ]
    jobs = []
    for i, edit in enumerate(edits):
        body = {"model": "m", "messages": [{"role": "user", "content": QUESTIONS[i]}], "interventions": edit}
        jobs.append((JobRequest.model_validate(body), 8 + i))

    def prepare(served, req, n, w=None):
        points = resolve_edits(req.interventions, served.info, False, n) if req.interventions else []
        return served.prepare(req, [], n, None, points)

    import tests.worker.test_batching as tb

    recorded: list[tuple] = []

    keep_keys = graph_keys(recorded)
    original = tb.prepare
    tb.prepare = prepare  # solo runs (the near-tie logits) prepare their jobs with the edits too
    try:
        replayed, _ = run_batched(graphs, jobs, join_at=[0, 0, 1, 3], wrap=keep_keys)
        eagerly, _ = run_batched(eager, jobs, join_at=[0, 0, 1, 3])
        assert any(key[5] for key in recorded), f"no graph recorded an edit: {recorded}"
        for index, (got, want) in enumerate(zip(replayed, eagerly, strict=True)):
            if dtype == "float32":
                assert torch.equal(got.token_ids, want.token_ids), index
                continue
            same = torch.equal(got.token_ids, want.token_ids)
            logits = None if same else _logits(eager, jobs[index])
            assert_close_to_solo(got, want, logits, TOLERANCE[dtype], str(index))
    finally:
        tb.prepare = original


def test_grammar_jobs_replay_the_sampler_after_their_masks_and_give_the_eager_tokens(engines, dtype):
    """Jobs with a JSON schema beside a free one: with graphs, each step's model pass goes ahead as
    a graph of its own and the sampler's graph follows once the masks are filled from the tokens
    just read (worker/batch/slot_decoding.py); the replies that end validate against the schema, and in
    float32 every job's tokens are the eager run's (bfloat16: within the near-tie check)."""
    import json

    import jsonschema

    from tests.worker.test_constrained import PERSON

    graphs, eager = engines
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    jobs = [
        job(QUESTIONS[0], 96, None, response_format=schema),
        job(QUESTIONS[1], 12, None),
        job(QUESTIONS[2], 96, None, response_format=schema, temperature=1.0, seed=4),
    ]
    recorded: list[tuple] = []

    keep_keys = graph_keys(recorded)
    replayed, _ = run_batched(graphs, jobs, join_at=[0, 0, 2], wrap=keep_keys)
    eagerly, _ = run_batched(eager, jobs, join_at=[0, 0, 2])
    kinds = {(key[-1], key[2]) for key in recorded}
    assert ("forward", False) in kinds and ("sample", True) in kinds, kinds
    for index, (got, want) in enumerate(zip(replayed, eagerly, strict=True)):
        if index != 1 and got.finish_reason == "stop":
            jsonschema.validate(json.loads(got.text), PERSON)
        if dtype == "float32":
            assert torch.equal(got.token_ids, want.token_ids), index
        elif index == 1:
            same = torch.equal(got.token_ids, want.token_ids)
            assert_close_to_solo(got, want, None if same else _logits(eager, jobs[index]), TOLERANCE[dtype], "free")


@pytest.mark.parametrize("key", ["mistral", "gemma2"])
def test_sliding_window_models_replay_their_rings_as_the_eager_step(key, tmp_path, smol_dir):
    """Mistral's and Gemma 2's sliding layers in slots (rings of their 8-token window, the window in
    the step's mask: worker/model/slots.py), replayed as CUDA graphs, give the eager step's tokens
    (float32), jobs joining and leaving past their window; the batch of one stays the compacted
    decoder's, `generate`'s arithmetic."""
    from tests.support.architectures import BY_KEY, available, build
    from worker.batch.served import ServedModel

    arch = BY_KEY[key]
    if reason := available(arch):
        pytest.skip(reason)
    graphs = load_engine(build(arch, tmp_path / key, smol_dir, chat_template=True), device=DEVICE, dtype="float32")
    eager = ServedModel(graphs.loaded, cuda_graphs=False)
    assert graphs.slides and "CUDA graphs" in graphs.describe_decoder()
    jobs = requests(GREEDY[:4])
    recorded: list[tuple] = []
    replayed, largest = run_batched(graphs, jobs, join_at=[0, 0, 2, 5], wrap=graph_keys(recorded))
    eagerly, _ = run_batched(eager, jobs, join_at=[0, 0, 2, 5])
    assert largest >= 3 and recorded, recorded
    for index, (got, want) in enumerate(zip(replayed, eagerly, strict=True)):
        assert torch.equal(got.token_ids, want.token_ids), (key, index)

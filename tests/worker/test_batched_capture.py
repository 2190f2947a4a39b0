"""Captures of jobs batched together against forward hooks on the plain model running `generate`
alone: the decoding steps' windows (worker/hooks/step_capture.py) and a prompt pass's block
(worker/hooks/pass_block.py) hand each job its own rows, whatever points, features, dtypes and
positions its neighbours keep."""

from __future__ import annotations

import pytest
import torch

from shared.capture_spec import resolve
from tests.worker.test_batching import QUESTIONS, RELATIVE_TOLERANCE, job, load_engine, prepare, run_batched
from worker.batch.sequence import Sequence
from worker.hooks import pass_block

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def served(tiny_dir):
    return load_engine(tiny_dir)


def test_jobs_keeping_different_points_features_and_dtypes_side_by_side_equal_forward_hooks(served, monkeypatch):
    """A window of decoding steps reaches each job in one copy (or one gather) of the rings' rows
    side by side: jobs that keep other modules, a feature subset, another dtype, or the same
    modules in another order, in one batch across several windows, each against forward hooks on
    the plain model running `generate` alone."""
    import worker.hooks.step_capture

    monkeypatch.setattr(worker.hooks.step_capture, "RING_STEPS", 4)  # a window every 2 steps
    specs = [
        {"modules": ["model.layers.{0,2}", "model.layers.1.mlp"], "positions": "generated"},
        {"modules": ["model.layers.1.mlp", "model.layers.0"], "positions": "generated", "features": [1, 5, 9]},
        {"modules": ["model.layers.2", "model.norm"], "positions": "all", "dtype": "float16"},
        {"modules": ["model.layers.0.mlp.up_proj"], "positions": "generated", "features": "8:24"},
    ]
    jobs = [job(QUESTIONS[i], 9 + i, spec) for i, spec in enumerate(specs)]
    batched, largest = run_batched(served, jobs, join_at=[0, 0, 1, 3])
    assert largest == 4
    assert_equal_forward_hooks(served, jobs, batched)


@pytest.mark.parametrize("block_bytes", [pass_block.BLOCK_BYTES, 1024], ids=["gathered", "over-the-cap"])
def test_jobs_prefilled_in_one_pass_keeping_different_points_features_and_dtypes_equal_forward_hooks(
    served, monkeypatch, block_bytes
):
    """A prompt pass of several jobs gathers each module's kept rows of every job at once and hands
    each job its rows in one copy (worker/hooks/pass_block.py): jobs of different prompt lengths
    (left-padded) that keep the same modules in another order, a feature subset, another dtype,
    the prompt's positions or only the last one, a module computed at the last position alone
    (`lm_head`, kept job by job beside the gathered ones) and a job that captures nothing, each
    against forward hooks on the plain model running `generate` alone. A block that would hold
    more than BLOCK_BYTES gathers nothing: every job keeps its rows one by one, the same."""
    monkeypatch.setattr(pass_block, "BLOCK_BYTES", block_bytes)
    taken: list[tuple[str, str]] = []
    take = pass_block.PassBlock.take

    def counting(self, key, value):
        done = take(self, key, value)
        if done:
            taken.append(key)
        return done

    monkeypatch.setattr(pass_block.PassBlock, "take", counting)
    specs = [
        {"modules": ["model.layers.{0,2}", "model.layers.1.mlp"], "positions": "all"},
        {"modules": ["model.layers.1.mlp", "model.layers.0"], "positions": "generated", "features": [1, 5, 9]},
        {"modules": ["model.layers.2", "model.norm"], "positions": "prompt", "dtype": "float16"},
        {"modules": ["model.layers.1.mlp", "model.layers.2", "model.layers.0"], "positions": "all"},
        None,
        {"modules": ["model.layers.1", "lm_head"], "positions": "generated", "features": [2, 7]},
    ]
    jobs = [job(QUESTIONS[i], 5 + i, spec) for i, spec in enumerate(specs)]
    seqs = [prepare(served, req, n) for req, n in jobs]
    assert len({s.prompt_tokens for s in seqs}) > 2  # left-padded
    ended: dict[int, Sequence] = {}
    with torch.inference_mode():
        decoder = served.decoder()
        try:
            decoder.admit_many(seqs)
            assert len(decoder.rows) == len(seqs)
            while decoder.rows:
                for seq in decoder.step():
                    ended[seqs.index(seq)] = seq
        finally:
            decoder.close()
    batched = [served.finish(ended[i], req) for i, (req, _) in enumerate(jobs)]
    assert_equal_forward_hooks(served, jobs, batched)
    # every module of the pass but lm_head (computed at the last position only) was gathered, or none
    wanted = {(c.point.module, c.point.hook) for got in batched for c in got.captured} - {("lm_head", "output")}
    assert set(taken) == (wanted if block_bytes > 1024 else set())


def assert_equal_forward_hooks(served, jobs, batched) -> None:
    """Each job's tokens and captures against forward hooks on the plain model running `generate` alone."""
    from tests.support.reference import hooked_generate, select

    for i, ((req, n), got) in enumerate(zip(jobs, batched, strict=True)):
        messages = [{"role": "user", "content": QUESTIONS[i]}]
        modules = [c.point.module for c in got.captured]
        ids, rows, prompt_tokens = hooked_generate(served.hf, served.tokenizer, messages, n, modules)
        assert torch.equal(got.token_ids, ids), i
        assert len(got.captured) == (len(resolve(req.capture, served.info)) if req.capture else 0), i
        for captured in got.captured:
            name = (i, captured.point.name)
            full = rows[captured.point.module]
            if captured.point.module == "lm_head":  # generate computes it at the last positions: the generated ones
                assert req.capture.positions == "generated" and full.shape[0] == n, name
                want = full
            else:
                want = select(full, req.capture.positions, prompt_tokens, n)
            if (features := req.capture.feature_indices(full.shape[1])) is not None:
                want = want[:, features]
            assert captured.tensor.dtype == getattr(torch, req.capture.dtype), name
            assert captured.tensor.shape == want.shape, name
            # batched rows are padded beside others: the module's float32 value within 1e-4 of its
            # scale, and a half-precision capture that value rounded (one rounding step apart at most)
            scale = float(want.abs().max())
            tolerance = max(RELATIVE_TOLERANCE, torch.finfo(captured.tensor.dtype).eps)
            assert float((captured.tensor.float() - want).abs().max()) <= tolerance * scale, name

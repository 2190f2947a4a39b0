"""An nnsight job on a CUDA engine whose decoding step replays as CUDA graphs: run in the middle
of a graph-replayed batch (and leaving a hook, train mode and a written weight behind, all put
back), it changes nothing of that batch: each job's tokens and captured rows equal the same batch
run without it, bit for bit, and the parameters keep their storage (the graphs read it)."""

# ruff: noqa: F841 - inside a trace, a name bound to a saved value is what nnsight sends back
from __future__ import annotations

import pytest
import torch

from shared.errors import WeightsWritten
from tests.gpu.test_gpu_engine import DEVICE, load_engine
from tests.worker.test_batching import job
from tests.worker.test_nnsight_jobs import client_model, payload, run_core, vandal

__all__ = ["client_model"]  # the fixture, shared


@pytest.fixture(scope="module")
def graphs(tiny_dir):
    engine = load_engine(tiny_dir, device=DEVICE, dtype="float32")
    assert "CUDA graphs" in engine.describe_decoder()
    return engine


def steer(model, backend):
    with model.generate("Once upon a time", max_new_tokens=4, backend=backend) as tracer:
        for _ in tracer.iter[0:4]:
            model.model.layers[1].output[:, -1, :] += 1.0
        ids = tracer.result.save()


@pytest.mark.parametrize("code", [vandal, steer], ids=["vandal", "steer"])
def test_an_nnsight_job_mid_batch_leaves_the_replayed_batch_exact(graphs, client_model, code):
    jobs = [job("What is 12 times 7?", 14), job("Name three colours.", 14), job("Count to five.", 10)]
    pointers = {name: p.data_ptr() for name, p in graphs.hf.named_parameters()}
    plain, _, _ = run_core(graphs, jobs)
    edited, core, steps_before = run_core(graphs, jobs, payload(client_model, code))
    assert steps_before and steps_before[0] > 0 and len(core.paused_s) == 1
    if code is vandal:
        assert isinstance(edited["alone"], WeightsWritten)
    else:
        assert edited["alone"].saves["ids"].shape[-1] > 4
    for i, (request, _) in enumerate(jobs):
        a, b = graphs.finish(plain[i], request), graphs.finish(edited[i], request)
        assert torch.equal(a.token_ids, b.token_ids), i
        for got, want in zip(b.captured, a.captured, strict=True):
            assert torch.equal(got.tensor, want.tensor), (i, got.point.name)
    assert {name: p.data_ptr() for name, p in graphs.hf.named_parameters()} == pointers

"""An nnsight job on the engine thread, in this process: it runs between two decoding steps of a
running batch, and whatever it does to the model (a hook left behind, train mode, a weight
written through `.data`) changes nothing of the batch's jobs, checked against their solo runs."""

# ruff: noqa: F841 - inside a trace, a name bound to a saved value is what nnsight sends back
from __future__ import annotations

import threading

import pytest
import torch

from shared.errors import NnsightCodeFailed, WeightsWritten
from tests.worker.test_batching import assert_same, job, prepare, solo
from worker.engine.core import Alone, EngineCore
from worker.engine.scheduler import Entry

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def served(tiny_dir):
    from shared.settings import Settings
    from worker.batch.served import ServedModel
    from worker.model.loading import load

    return ServedModel(load(Settings(model=str(tiny_dir), model_name="m")))


@pytest.fixture(scope="module")
def client_model(tiny_dir):
    from nnsight.modeling import huggingface
    from nnsight.modeling.transformers import TransformersModel
    from transformers import AutoTokenizer

    huggingface._ID_CACHE[str(tiny_dir)] = str(tiny_dir)
    return TransformersModel(str(tiny_dir), task="text-generation", tokenizer=AutoTokenizer.from_pretrained(tiny_dir))


def payload(model, code) -> bytes:
    """The bytes nnsight's client would send for `code(model, backend)`."""
    from nnsight.schema.request import RequestModel
    from nnsight.tracing.backend import Backend

    sent: list[bytes] = []

    class Keep(Backend):
        def __call__(self, tracer):
            sent.append(RequestModel.serialize(tracer))

    code(model, Keep())
    return sent[0]


def vandal(model, backend):
    """Leaves a hook that zeroes layer 0, the model in train mode, and a weight scaled."""
    with model.trace("Hello", backend=backend):
        model.model.layers[0]._module.register_forward_hook(lambda module, args, out: out * 0)
        model._module.train()
        model.model.layers[1].mlp.down_proj.weight.data.mul_(3)
        hs = model.model.layers[1].output.save()


def tidy(model, backend):
    """Leaves only a hook behind (the job succeeds; the hook is taken off and reported)."""
    with model.trace("Hello", backend=backend):
        model.model.layers[0]._module.register_forward_hook(lambda module, args, out: out * 0)
        hs = model.model.layers[1].output.save()


def broken(model, backend):
    with model.trace("Hello", backend=backend):
        hs = model.model.layers[1].output.save()
        int("not a number")  # the ValueError is the point


def run_core(served, jobs, blob: bytes | None = None, at_token: int = 4):
    """`jobs` in one EngineCore batch; with `blob`, that nnsight payload runs as the first job
    reaches `at_token` tokens (the batch decoding). Returns (outcomes by index and "alone", core,
    the decoding steps run before the payload)."""
    from worker.nnsight import jobs as nnsight_jobs

    outcomes: dict[object, object] = {}
    steps_before: list[int] = []
    finished = threading.Event()
    core = EngineCore(served, max_batch=4, wait_s=0.2)

    def watch(tokens: int) -> None:
        if blob is not None and tokens == at_token and "alone" not in outcomes:
            outcomes["alone"] = None
            steps_before.append(core.stats.steps)
            run = lambda: nnsight_jobs.run(served, blob, False, 30, print)  # noqa: E731
            core.run_alone(Alone(run=run, done=lambda outcome: outcomes.__setitem__("alone", outcome)))

    def done_for(i: int):
        def done(outcome):
            outcomes[i] = outcome
            if all(k in outcomes for k in range(len(jobs))):
                finished.set()

        return done

    seqs = [prepare(served, *jobs[0], watch=watch), *(prepare(served, *j) for j in jobs[1:])]
    for i, seq in enumerate(seqs):
        core.submit(Entry(seq=seq, done=done_for(i)))
    core.start()
    try:
        assert finished.wait(120)
    finally:
        core.stop()
    return outcomes, core, steps_before


def test_an_nnsight_job_between_decoding_steps_changes_nothing_of_the_running_batch(served, client_model):
    jobs = [job("What is 12 times 7?", 14), job("Name three colours.", 14)]
    pointers = {name: p.data_ptr() for name, p in served.hf.named_parameters()}
    outcomes, core, steps_before = run_core(served, jobs, payload(client_model, vandal))
    assert isinstance(outcomes["alone"], WeightsWritten)
    assert len(core.paused_s) == 1 and steps_before and steps_before[0] > 0  # it ran while the batch decoded
    for i in (0, 1):
        assert_same(served.finish(outcomes[i], jobs[i][0]), solo(served, *jobs[i]), f"job {i}")
    assert {name: p.data_ptr() for name, p in served.hf.named_parameters()} == pointers
    assert not any(m.training or m._forward_hooks or "forward" in m.__dict__ for m in served.hf.modules())


def test_exclusive_work_runs_with_nothing_decoding(served):
    ran: list[object] = []
    both = threading.Event()

    def done(outcome: object) -> None:
        ran.append(outcome)
        if len(ran) == 2:
            both.set()

    core = EngineCore(served, max_batch=4).start()
    try:
        core.run_alone(Alone(run=lambda: 7, done=done))
        core.run_alone(Alone(run=lambda: 1 / 0, done=done))
        assert both.wait(30)
        assert core.alive  # what the work raised was its answer, not the engine thread's end
    finally:
        core.stop()
    assert ran[0] == 7 and isinstance(ran[1], ZeroDivisionError)


def test_what_a_job_leaves_is_reported_and_its_failures_are_its_own(served, client_model):
    from worker.nnsight import jobs as nnsight_jobs

    lines: list[str] = []
    before = solo(served, *job("What is 12 times 7?", 6))
    tidy_outcome = nnsight_jobs.run(served, payload(client_model, tidy), False, 30, lines.append)
    assert tidy_outcome.saves["hs"].shape[-1] == 64
    assert tidy_outcome.restored == ["model.layers.0: _forward_hooks"]
    with pytest.raises(WeightsWritten, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        nnsight_jobs.run(served, payload(client_model, vandal), False, 30, lines.append)
    with pytest.raises(NnsightCodeFailed, match="ValueError: invalid literal for int"):
        nnsight_jobs.run(served, payload(client_model, broken), False, 30, lines.append)
    after = solo(served, *job("What is 12 times 7?", 6))
    assert_same(after, before, "after three nnsight jobs")
    assert torch.is_grad_enabled()

"""Failure atomicity of the engine, by injection: a tiny random model runs a batch (jobs joining
together and apart, leaving at different steps, a trace pass beside them, a long prompt fed in
chunks between steps), and a torch function
mode makes the k-th tensor operation of the scheduler's turn fail, for every k in turn, out of
memory and otherwise. The model's whole forward pass counts as one operation (it fails at its
start); inside it, the capture hooks' own failures are the job's (tested in test_capture.py).

By default each distinct (operation, call site in worker/) fails once, at its first run, out of
memory or otherwise in turn (the distinct sites in the order they first run, alternately: 97 and
96 of the 193 on the slot decoder; failing every one both ways took twice the time, 543 s of a CI
run's 7,185 s of tests). The exhaustive sweep fails every k both ways (1,076 operations on the
slot decoder) and runs with `make test-exhaustive` (pytest --exhaustive -m exhaustive).

Whatever fails where: every job gets exactly one answer, its own result (equal to the same job run
alone) or its own failure; no job that finished is lost; and the same scheduler then runs a new
job exactly as alone (the batch goes on)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from shared.errors import JobFailure, OutOfMemory
from tests.worker.test_batching import assert_same, job, load_engine, prepare, solo
from worker.engine.core import EngineCore
from worker.engine.scheduler import Entry

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.exhaustive]
WORKER = str(Path(__file__).resolve().parents[2] / "worker")

CAPTURE = {"modules": ["model.layers.{0,1}", "model.norm"], "positions": "all"}
JOBS = [  # (question, max_tokens, fields): joins together, leaves at different steps; a trace
    ("What is 2+3?", 3, {}),
    ("Name three colours.", 10, {"logprobs": True, "top_logprobs": 2}),  # past RING_STEPS (4 here)
    ("Count to five.", 4, {"temperature": 0.8, "seed": 7}),
    ("Write a haiku.", 0, {"mode": "trace", "logprobs": True}),
    # longer than the others: fed in chunks (the chunk is the longest of the others' prompts)
    ("Natalia sold clips to 48 of her friends in April, and half as many in May. How many?", 3, {}),
]


# Reading a tensor's metadata (shape, dtype, device: property getters) allocates and computes
# nothing and cannot fail; every other operation can.
METADATA = {"__get__", "dim", "size", "numel", "is_floating_point", "element_size", "get_device"}


class FailAt(TorchFunctionMode):
    """Counts the tensor operations run outside the model's forward pass (the forward itself counts
    as one) and makes operation `at` raise `error`."""

    def __init__(self, model: torch.nn.Module, at: int, error: type[Exception]) -> None:
        super().__init__()
        self.at, self.error, self.count, self.depth = at, error, 0, 0
        self.failed = self.active = False
        self.sites: list[tuple[str, str]] = []  # each operation's (name, worker/ line that ran it)
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave),
        ]

    def _tick(self, what: object) -> None:
        self.count += 1
        if self.at == 0:  # the counting run: where each operation comes from
            self.sites.append((str(what), _call_site()))
        if self.count == self.at:
            self.failed = True
            raise self.error(f"injected at operation {self.count} ({what})")

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)

    def _enter(self, *_: object) -> None:
        if not self.active:
            return
        if self.depth == 0:
            self._tick("the forward pass")
        self.depth += 1

    def _leave(self, *_: object) -> None:
        if self.active:
            self.depth -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.depth == 0 and getattr(func, "__name__", "") not in METADATA:
            self._tick(getattr(func, "__name__", func))
        return func(*args, **(kwargs or {}))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _call_site() -> str:
    """The innermost line of worker/ code on the stack: the operation's call site."""
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(WORKER):
        frame = frame.f_back
    return "?" if frame is None else f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


@dataclass
class Answers:
    got: dict[int, list[object]] = field(default_factory=dict)

    def entry(self, index: int, seq) -> Entry:
        return Entry(seq=seq, done=lambda outcome: self.got.setdefault(index, []).append(outcome))


@pytest.fixture(scope="module")
def served(smol_dir, tmp_path_factory):
    """The tiny model with 2 layers, not 4: every run of the sweep is mostly forward passes, and
    the scenario captures no deeper than layer 1."""
    from tests.support.tiny_model import build

    return load_engine(build(tmp_path_factory.mktemp("two-layers") / "tiny", smol_dir, num_hidden_layers=2))


@pytest.fixture(params=["slots", "overlapped", "compacted"])
def decoder_kind(request, served, monkeypatch):
    """The decoder in slots (this model's); the same with each step launched before the last
    one's tokens are read (as when steps replay as CUDA graphs), forced on the CPU; and the
    compacting one that sliding-window models keep, forced on the same model."""
    if request.param == "compacted":
        monkeypatch.setattr(served, "slot_reason", "forced by the test: the compacting decoder")
    if request.param == "overlapped":
        from worker.batch.slot_decoding import SlotDecoder

        monkeypatch.setattr(SlotDecoder, "overlap", True, raising=False)
    return request.param


@pytest.fixture(scope="module")
def requests():
    return [job(q, n, CAPTURE, **fields) for q, n, fields in JOBS]


@pytest.fixture
def alone(served, requests, decoder_kind):
    """Each job run alone by the decoder under test (their seeded draws differ: the slots' sampler
    is counter-based, the compacting decoder's is transformers' own with a generator per job)."""
    return [solo(served, req, n) for req, n in requests]


@pytest.fixture(autouse=True)
def quiet(caplog):
    """The engine logs each injected failure with its traceback; pytest keeps every record of a
    test, and a traceback keeps its frames (and the decoder they reference) alive: thousands of
    runs in one test would hold thousands of decoders. Nothing here reads the log."""
    caplog.set_level(logging.CRITICAL, logger="worker")


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch):
    """The scheduler's fair share times prefill work against decoding steps; a clock that ticks
    once per reading makes the order of operations the same in every run (one unit each way).
    Staging rings of 4 steps: the scenario fills them (more than twice), joins rows into them and
    compacts them. The runs are quadratic in the scenario's length (every operation of a run is
    failed in a run of its own): 4 and 10 tokens instead of 8 and 18 halve the test's time."""
    import itertools

    import worker.engine.core
    import worker.hooks.step_capture

    monkeypatch.setattr(worker.engine.core, "clock", itertools.count().__next__)
    monkeypatch.setattr(worker.hooks.step_capture, "RING_STEPS", 4)  # so that the scenario fills the rings


def run(served, requests, mode: FailAt | None) -> tuple[Answers, EngineCore, object]:
    answers = Answers()
    core = EngineCore(served, max_batch=5)
    seqs = [prepare(served, req, n) for req, n in requests]
    for i, seq in enumerate(seqs):
        core.submit(answers.entry(i, seq))
    with torch.inference_mode():
        decoder = served.decoder()
        decoder.chunk_tokens = max(seq.prompt_tokens for seq in seqs[:-1])
        assert seqs[-1].prompt_tokens > decoder.chunk_tokens
        try:
            for _ in range(50):
                if len(answers.got) == len(requests) and not decoder.rows:
                    break
                if mode is not None:
                    with mode:
                        core.tick(decoder)
                else:
                    core.tick(decoder)
            # the batch goes on: a new job, after whatever failed, runs exactly as alone
            req, n = requests[0]
            core.submit(answers.entry(99, prepare(served, req, n)))
            for _ in range(20):
                if 99 in answers.got:
                    break
                core.tick(decoder)
        finally:
            decoder.close()
    return answers, core, decoder


def operations(served, requests) -> list[tuple[str, str]]:
    """Each tensor operation of the scenario's run, in order: (name, call site)."""
    mode = FailAt(served.hf, at=0, error=RuntimeError)
    try:
        answers, _, _ = run(served, requests, mode)
    finally:
        mode.remove()
    assert all(len(a) == 1 for a in answers.got.values())
    assert len(mode.sites) == mode.count
    return mode.sites


def failure_points(sites: list[tuple[str, str]], exhaustive: bool, turn: int = 0) -> list[int]:
    """Which operations to fail (1-based): every one, or the first run of each distinct one whose
    place among the distinct ones (in the order they first run) is `turn` modulo 2."""
    if exhaustive:
        return list(range(1, len(sites) + 1))
    first: dict[tuple[str, str], int] = {}
    for at, site in enumerate(sites, start=1):
        first.setdefault(site, at)
    return sorted(first.values())[turn::2]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError], ids=["out-of-memory", "other"])
def test_any_operation_failing_once_leaves_every_job_one_answer_of_its_own(
    served, requests, alone, error, decoder_kind, pytestconfig
):
    sites = operations(served, requests)
    total = len(sites)
    assert total > 50  # the scenario runs joins, steps, leaves and a trace pass
    exhaustive = pytestconfig.getoption("exhaustive")
    points = failure_points(sites, exhaustive, turn=0 if error is torch.OutOfMemoryError else 1)
    assert "?" not in {site for _, site in sites}, "an operation outside worker/ code"
    assert len(set(sites)) > 20
    distinct = {sites[at - 1] for at in points}  # one kind's half of the distinct ones, at least
    assert len(distinct) == len(points) >= len(set(sites)) // 2 or exhaustive
    failed_jobs = 0
    for at in points:
        mode = FailAt(served.hf, at=at, error=error)
        try:
            answers, core, decoder = run(served, requests, mode)
        finally:
            mode.remove()
        assert mode.failed, at
        where = f"failure injected at operation {at} of {total}"
        assert type(decoder).__name__ == ("Decoder" if decoder_kind == "compacted" else "SlotDecoder")
        assert sorted(answers.got) == [*range(len(requests)), 99], where
        assert all(len(a) == 1 for a in answers.got.values()), where  # exactly one answer each
        assert not core.scheduler.active and not core.scheduler.feeding and not decoder.rows, where
        for index, [answer] in answers.got.items():
            req, n = requests[0] if index == 99 else requests[index]
            want = alone[0] if index == 99 else alone[index]
            try:
                got = served.finish(answer, req) if not isinstance(answer, Exception) else None
            except JobFailure as exc:
                answer = exc
                got = None
            if got is not None:
                assert_same(got, want, f"job {index}, {where}")
                continue
            failed_jobs += 1
            assert index != 99, f"the job after the fault failed: {answer!r}, {where}"
            if error is torch.OutOfMemoryError:
                assert isinstance(answer, OutOfMemory), (answer, where)
            else:
                assert "injected" in str(answer), (answer, where)
    assert failed_jobs > 0  # the injections reached the jobs

"""The engine core against a fake batch (no model, no tensors): every job it takes in gets exactly
one answer whatever fails where; callbacks and exceptions that escape; the watchdog that ends the
engine process when its thread dies; exclusive runs (trusted code) taking turns with the batch."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from shared.errors import OutOfMemory
from tests.support.fake_batch import FakeBatch, FakeSeq, FakeServed, Injected, Job, entries, random_jobs, run
from worker.engine.core import ENGINE_THREAD_DIED, EngineCore
from worker.engine.scheduler import Entry


@pytest.mark.parametrize("seed", range(40))
def test_every_job_gets_exactly_one_answer_whatever_fails(seed: int) -> None:
    rng = random.Random(seed)
    jobs = random_jobs(rng, rng.randint(1, 12))
    kinds = [lambda: Injected("injected"), lambda: torch.OutOfMemoryError("injected out of memory")]
    fail_at = {rng.randint(1, 30): rng.choice(kinds)() for _ in range(rng.randint(0, 4))}
    batch = FakeBatch(fail_at, chunk_tokens=rng.choice([None, 512]))  # 2,000-token prompts: in 4 chunks
    core = EngineCore(FakeServed(batch), max_batch=rng.choice([1, 3, 8]))  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    for job in jobs:
        assert len(job.answers) == 1, job
        assert job.starts == 1, job
        answer = job.answers[0]
        if answer is job.seq:  # its own result: it ran to its end
            assert job.seq.ended in ("length", "trace")
            assert len(job.seq.generated) == max(job.seq.max_tokens, 0) or job.seq.trace
        else:  # its own failure: the injected error, or out of memory
            assert isinstance(answer, (Injected, OutOfMemory)), answer
    assert not core.scheduler.active and not batch.rows
    # the batch goes on: a job after all that runs to its end
    after = [Job(FakeSeq(prompt_tokens=4, max_tokens=3))]
    batch.fail_at = {}
    for entry in entries(after):
        core.submit(entry)
    run(core, batch, after)
    assert after[0].answers == [after[0].seq]


def test_a_failed_step_fails_the_rows_in_it_and_only_them() -> None:
    batch = FakeBatch({2: Injected("step")})  # call 1: the three jobs' one prefill; 2: the first step
    jobs = [Job(FakeSeq(3, 5)) for _ in range(3)]
    core = EngineCore(FakeServed(batch), max_batch=3, wait_s=0.05)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert all(isinstance(job.answers[0], Injected) for job in jobs)
    later = [Job(FakeSeq(3, 4))]
    for entry in entries(later):
        core.submit(entry)
    run(core, batch, later)
    assert later[0].answers == [later[0].seq]


def test_a_trace_pass_out_of_memory_runs_in_halves_and_only_the_one_that_cannot_fit_alone_fails() -> None:
    batch = FakeBatch({3: torch.OutOfMemoryError("the long trace alone (fake)")})
    jobs = [Job(FakeSeq(2000, 0)), Job(FakeSeq(2001, 0))]  # one pass; halves; the second half fails
    core = EngineCore(FakeServed(batch), max_batch=4, wait_s=0.05)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert jobs[0].answers == [jobs[0].seq]
    assert isinstance(jobs[1].answers[0], OutOfMemory)


def test_a_callback_that_raises_does_not_stop_the_engine() -> None:
    batch = FakeBatch()
    seq = FakeSeq(3, 2)

    def done(_outcome: object) -> None:
        raise RuntimeError("a broken callback")

    core = EngineCore(FakeServed(batch), max_batch=2)  # type: ignore[arg-type]
    core.submit(Entry(seq=seq, done=done))  # type: ignore[arg-type]
    for _ in range(5):
        core.tick(batch)  # type: ignore[arg-type]
    assert seq.ended == "length"
    after = [Job(FakeSeq(3, 2))]
    for entry in entries(after):
        core.submit(entry)
    run(core, batch, after)
    assert after[0].answers == [after[0].seq]


def test_an_exception_that_escapes_the_engine_thread_calls_on_death() -> None:
    class Broken(FakeBatch):
        @property  # type: ignore[override]
        def rows(self) -> list[FakeSeq]:
            raise KeyError("a bug outside every guarded call")

        @rows.setter
        def rows(self, value: list[FakeSeq]) -> None:
            pass

    died: list[BaseException] = []
    dead = threading.Event()

    def on_death(exc: BaseException) -> None:
        died.append(exc)
        dead.set()

    core = EngineCore(FakeServed(Broken()), max_batch=2, on_death=on_death)  # type: ignore[arg-type]
    core.start()
    assert dead.wait(10)
    assert isinstance(died[0], KeyError)
    core._thread.join(5)
    assert not core.alive


def test_by_default_a_dead_engine_thread_ends_the_process_with_the_reason_logged() -> None:
    script = textwrap.dedent(
        """
        import logging, sys, threading, time
        sys.path.insert(0, ".")
        from tests.worker.test_scheduler import FakeBatch, FakeServed
        from worker.engine.core import EngineCore

        class Broken(FakeBatch):
            def close(self):
                pass
        served = FakeServed(Broken())
        def decoder(slots=1):
            raise ZeroDivisionError("the engine's own bug")
        served.decoder = decoder
        logging.basicConfig(level=logging.INFO)
        EngineCore(served, max_batch=2).start()
        time.sleep(30)
        print("still running")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == ENGINE_THREAD_DIED, proc
    assert "the engine thread died (ZeroDivisionError: the engine's own bug)" in proc.stderr
    assert "still running" not in proc.stdout


def test_the_way_out_of_a_dead_engine_thread_cannot_hang_or_raise() -> None:
    """Trusted code that set the recursion limit to 30 (issue 46: the process then lingered 31
    minutes, `logging` raising before `os._exit`), a log handler that raises and an exception
    whose `str` raises: the process still ends with ENGINE_THREAD_DIED, and says why first."""
    script = textwrap.dedent(
        """
        import logging, sys, threading, time
        sys.path.insert(0, ".")
        from tests.worker.test_scheduler import FakeBatch, FakeServed
        from worker.engine import core as engine_core
        from worker.engine.core import EngineCore

        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no words")

        class Raising(logging.Handler):
            def emit(self, record):
                raise RuntimeError("the handler fails")

        logging.getLogger().addHandler(Raising())
        logging.raiseExceptions = True
        engine_core.last_words = lambda text: print("last words:", text, flush=True)
        served = FakeServed(FakeBatch())
        def decoder(slots=1):
            sys.setrecursionlimit(30)
            raise Unprintable()
        served.decoder = decoder
        EngineCore(served, max_batch=2).start()
        time.sleep(30)
        print("still running")
        """
    )
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == ENGINE_THREAD_DIED, proc
    assert "last words: Unprintable" in proc.stdout
    assert "still running" not in proc.stdout
    assert time.monotonic() - began < 25  # the sleep is 30 s: the process ended on its own


# -- exclusive runs (trusted nnsight code on the shared engine) --------------------------------


def test_exclusive_runs_take_turns_by_owner_and_the_batch_advances_between_them(monkeypatch) -> None:
    """Three exclusive runs of two owners beside a running batch: owners alternate (a, b, a, not
    a, a, b), and after each run the batch is served as long as the run held the model before the
    next one (issue 46: one trusted key held everyone's jobs for minutes, back to back). The
    clock is the engine core's own, advanced by the fake work (no timing here)."""
    from worker.engine import core as engine_core
    from worker.engine.core import Alone

    now = [0.0]
    monkeypatch.setattr(engine_core, "clock", lambda: now[0])
    batch = FakeBatch()
    original_step = batch.step

    def step() -> list[FakeSeq]:
        now[0] += 0.4  # a decoding step's time
        return original_step()

    batch.step = step  # type: ignore[method-assign]
    core = EngineCore(FakeServed(batch), max_batch=4)  # type: ignore[arg-type]
    long = [Job(FakeSeq(3, 40))]
    for entry in entries(long):
        core.submit(entry)
    core.tick(batch)  # type: ignore[arg-type]  # the prefill and a first step: the batch runs
    assert batch.rows
    order: list[str] = []

    def run_for(name: str) -> Alone:
        def body() -> str:
            batch.log.append(f"alone {name}")
            order.append(name)
            now[0] += 1.0  # the run holds the model a second
            return name

        return Alone(run=body, done=lambda _: None, job_id=name, owner=name[0])

    for name in ("a1", "a2", "b1"):
        core.run_alone(run_for(name))
    for _ in range(30):
        core.tick(batch)  # type: ignore[arg-type]
    assert order == ["a1", "b1", "a2"]
    between = [i for i, what in enumerate(batch.log) if what.startswith("alone")]
    for first, second in zip(between, between[1:], strict=False):
        steps = batch.log[first + 1 : second].count("step")
        assert steps >= 3, batch.log  # 1 s held, 0.4 s a step: at least three steps before the next
    assert len(core.paused_s) == 3 and core.stats.take_holds() == pytest.approx([1.0, 1.0, 1.0])


def test_an_exclusive_run_that_cannot_prove_the_model_whole_stops_the_engine_before_anyone_else_runs() -> None:
    """An answer with `unproven` (worker/nnsight/guard.py) stops the loop: `on_replace` is told
    before the answer is handed back, and no prefill, step or other run happens after it."""
    from shared.errors import NnsightCodeFailed
    from worker.engine.core import Alone

    batch = FakeBatch()
    told: list[tuple[str, list[str]]] = []
    answers: list[object] = []
    core = EngineCore(FakeServed(batch), max_batch=4, on_replace=lambda job, why: told.append((job, why)))  # type: ignore[arg-type]
    jobs = [Job(FakeSeq(3, 40))]
    for entry in entries(jobs):
        core.submit(entry)
    core.tick(batch)  # type: ignore[arg-type]
    failure = NnsightCodeFailed("it patched torch")
    failure.unproven = ["torch.nn.functional.silu replaced"]  # type: ignore[attr-defined]

    def raise_it() -> None:
        raise failure

    def answered(outcome: object) -> None:
        assert told, "on_replace comes before the answer"
        answers.append(outcome)

    core.run_alone(Alone(run=raise_it, done=answered, job_id="j1"))
    core.run_alone(Alone(run=lambda: answers.append("ran after"), done=lambda _: None, job_id="j2"))
    before = list(batch.log)
    core.tick(batch)  # type: ignore[arg-type]
    assert told == [("j1", ["torch.nn.functional.silu replaced"])] and answers == [failure]
    assert core.replaced == ["torch.nn.functional.silu replaced"]
    assert batch.log == before  # nothing ran after it
    assert core._stop.is_set()

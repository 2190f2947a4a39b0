"""The served model's gate (worker/batch/gate.py): while trusted code runs, no other thread reads the
tokenizer for a job (an outside round's code replaced the chat template, and another key's chat
rendered with it); readers share the gate; a waiting exclusive run is not starved."""

from __future__ import annotations

import threading

from tests.worker.test_scheduler import FakeBatch, FakeServed
from worker.batch.gate import Gate
from worker.engine.core import Alone, EngineCore


def _reader(gate: Gate, entered: threading.Event) -> threading.Thread:
    def read() -> None:
        with gate.reading():
            entered.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_no_reader_enters_while_an_exclusive_run_holds_the_gate() -> None:
    gate = Gate()
    entered = threading.Event()
    with gate.exclusive():
        reader = _reader(gate, entered)
        assert not entered.wait(0.3)  # shut: it waits (however long this waited)
    assert entered.wait(10)
    reader.join(10)


def test_readers_share_the_gate_and_a_waiting_run_goes_before_later_readers() -> None:
    gate = Gate()
    order: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def first() -> None:
        with gate.reading():
            order.append("reader 1")
            first_in.set()
            release_first.wait(10)

    threading.Thread(target=first, daemon=True).start()
    assert first_in.wait(10)
    with gate.reading():  # a second reader shares it
        order.append("reader 2")
    run_in = threading.Event()

    def run() -> None:
        with gate.exclusive():
            order.append("run")
            run_in.set()

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    while not gate._waiting:  # the run waits for reader 1
        threading.Event().wait(0.01)
    late = threading.Event()
    later = _reader(gate, late)
    assert not late.wait(0.3)  # a reader after a waiting run waits for it
    release_first.set()
    assert run_in.wait(10) and late.wait(10)
    runner.join(10)
    later.join(10)
    assert order == ["reader 1", "reader 2", "run"]


def test_the_engine_runs_exclusive_work_with_the_gate_shut() -> None:
    batch = FakeBatch()
    served = FakeServed(batch)
    core = EngineCore(served, max_batch=2)  # type: ignore[arg-type]
    seen: list[bool] = []
    answers: list[object] = []

    def body() -> str:
        entered = threading.Event()
        reader = _reader(served.gate, entered)
        seen.append(entered.wait(0.3))  # a reader in another thread cannot enter meanwhile
        return "ran" if reader.is_alive() else "a reader got in"

    core.run_alone(Alone(run=body, done=answers.append, job_id="j"))
    core.tick(batch)  # type: ignore[arg-type]
    assert answers == ["ran"] and seen == [False]

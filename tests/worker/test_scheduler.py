"""The engine core and its scheduler, against a fake batch (no model, no tensors): every job it takes in gets
exactly one answer whatever fails where; the memory budget; the watchdog that ends the engine
process when its thread dies."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from shared.errors import OutOfMemory
from worker.engine.core import ENGINE_THREAD_DIED, EngineCore
from worker.engine.scheduler import Entry


@dataclass(eq=False)
class FakeSeq:
    prompt_tokens: int
    max_tokens: int  # 0: a trace
    generated: list[int] = field(default_factory=list)
    ended: str | None = None
    capture: None = None
    scores: object = None

    @property
    def trace(self) -> bool:
        return self.max_tokens == 0


class Injected(RuntimeError):
    pass


class FakeBatch:
    """The decoder's contract: `admit_many` is all or nothing, `step` returns the rows that ended
    (out of the batch), `trace` ends every sequence it ran; `fail_at` maps a call's number (prefill,
    step and trace calls counted together) to the exception that call raises."""

    def __init__(self, fail_at: dict[int, BaseException] | None = None, chunk_tokens: int | None = None) -> None:
        self.rows: list[FakeSeq] = []
        self.most_rows: int | None = None
        self.chunk_tokens = chunk_tokens
        self.log: list[str] = []  # "chunk" / "step" / "prefill" / "trace", in order
        self.fail_at = fail_at or {}
        self.calls = 0
        self.largest = 0
        self.prefills: list[int] = []  # jobs per prefill pass
        self.cache_rows: int | None = None

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.calls in self.fail_at:
            raise self.fail_at[self.calls]

    def admit_many(self, seqs: list[FakeSeq]) -> None:
        self._maybe_fail()  # before any change: all or nothing
        self.log.append("prefill")
        self.prefills.append(len(seqs))
        for seq in seqs:
            self._first_token(seq)
        self.largest = max(self.largest, len(self.rows))

    def _first_token(self, seq: FakeSeq) -> None:
        seq.generated.append(1)
        if len(seq.generated) >= seq.max_tokens:
            seq.ended = "length"
        else:
            self.rows.append(seq)

    def feed(self, item, most: int) -> bool:
        """One chunk of a long prompt: True once it is all fed (a trace ended, a generation joined)."""
        self._maybe_fail()
        self.log.append("chunk")
        assert most == self.chunk_tokens
        item.fed = min(item.seq.prompt_tokens, item.fed + most)
        if item.fed < item.seq.prompt_tokens:
            return False
        if item.seq.trace:
            item.seq.ended = "trace"
        else:
            self._first_token(item.seq)
            self.largest = max(self.largest, len(self.rows))
        return True

    def wants_logits(self, seq: FakeSeq) -> bool:
        return seq.scores is not None

    def must_wait(self, joining: list[FakeSeq]) -> bool:
        """A KV cache with room for `cache_rows` sequences at once (None: no cap)."""
        return self.cache_rows is not None and len(self.rows) + len(joining) > self.cache_rows

    def idle(self) -> None:
        pass

    def cache_size(self) -> tuple[int, int, int]:
        return (0, 0, 0)

    def step(self) -> list[FakeSeq]:
        self._maybe_fail()
        self.log.append("step")
        for row in self.rows:
            row.generated.append(1)
            if len(row.generated) >= row.max_tokens:
                row.ended = "length"
        ended = [row for row in self.rows if row.ended]
        self.rows = [row for row in self.rows if not row.ended]
        return ended

    def trace(self, seqs: list[FakeSeq]) -> None:
        self._maybe_fail()
        self.log.append("trace")
        if len(seqs) > 1 and any(s.prompt_tokens > 1000 for s in seqs):
            raise torch.OutOfMemoryError("a pass of long traces does not fit (fake)")
        for seq in seqs:
            seq.ended = "trace"

    def reset(self) -> None:
        self.rows = []

    def close(self) -> None:
        pass


class FakeServed:
    def __init__(self, batch: FakeBatch) -> None:
        from worker.batch.gate import Gate

        self.lock = threading.Lock()
        self.gate = Gate()
        self.batch = batch

    def decoder(self, slots: int = 1) -> FakeBatch:
        return self.batch

    def trace_cost(self, seq: FakeSeq, padded: int) -> int:
        return padded


@dataclass
class Job:
    seq: FakeSeq
    answers: list[object] = field(default_factory=list)
    starts: int = 0


def entries(jobs: list[Job], estimate: int = 0) -> list[Entry]:
    def entry(job: Job) -> Entry:
        def started() -> None:
            job.starts += 1

        return Entry(seq=job.seq, done=job.answers.append, estimate=estimate, started=started)  # type: ignore[arg-type]

    return [entry(job) for job in jobs]


def run(core: EngineCore, batch: FakeBatch, jobs: list[Job], ticks: int = 500) -> None:
    """Drive the engine loop in this thread until every job is answered (or `ticks` turns)."""
    for _ in range(ticks):
        if all(job.answers for job in jobs):
            return
        core.tick(batch)  # type: ignore[arg-type]
    raise AssertionError(f"unanswered after {ticks} turns: {[j.seq for j in jobs if not j.answers]}")


def random_jobs(rng: random.Random, n: int) -> list[Job]:
    return [
        Job(FakeSeq(prompt_tokens=rng.choice([3, 50, 2000]), max_tokens=rng.choice([0, 0, 1, 2, 5, 9])))
        for _ in range(n)
    ]


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


def test_over_the_memory_budget_a_job_waits_for_room_and_a_job_alone_always_runs() -> None:
    batch = FakeBatch()
    jobs = [Job(FakeSeq(3, 4)), Job(FakeSeq(3, 4)), Job(FakeSeq(3, 4))]
    core = EngineCore(FakeServed(batch), max_batch=8, budget_bytes=250)  # type: ignore[arg-type]
    for entry in entries(jobs, estimate=100):  # two fit in the budget, the third waits
        core.submit(entry)
    run(core, batch, jobs)
    assert batch.largest == 2
    assert all(job.answers == [job.seq] for job in jobs)
    huge = [Job(FakeSeq(3, 2))]
    for entry in entries(huge, estimate=10_000):
        core.submit(entry)
    run(core, batch, huge)
    assert huge[0].answers == [huge[0].seq]


def test_a_job_the_batchs_kv_cache_cannot_hold_yet_waits_at_the_head_and_a_job_alone_always_runs() -> None:
    """The batch says a join must wait (its KV cache's cap, worker/model/slot_sizing.py): the job goes
    back to the head of the queue, no later job passes it, and it joins once rows have left.
    With nothing running, a job is taken in whatever the batch says (it is refused at its join
    if it cannot fit alone)."""
    batch = FakeBatch()
    batch.cache_rows = 2
    jobs = [Job(FakeSeq(3, 6)), Job(FakeSeq(3, 3)), Job(FakeSeq(3, 4)), Job(FakeSeq(3, 2))]
    core = EngineCore(FakeServed(batch), max_batch=8)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert batch.largest == 2 and batch.prefills == [2, 1, 1], batch.prefills
    assert all(job.answers == [job.seq] for job in jobs)
    batch.cache_rows = 0  # not even one fits: alone, it runs all the same
    alone = [Job(FakeSeq(3, 2))]
    for entry in entries(alone):
        core.submit(entry)
    run(core, batch, alone)
    assert alone[0].answers == [alone[0].seq]


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


def test_jobs_taken_in_together_prefill_in_passes_of_similar_lengths() -> None:
    batch = FakeBatch()
    lengths = [100, 101, 100, 200, 205, 102]  # two passes: the short ones, the long ones
    jobs = [Job(FakeSeq(n, 3)) for n in lengths]
    core = EngineCore(FakeServed(batch), max_batch=8, wait_s=0.05)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert sorted(batch.prefills) == [2, 4]
    assert all(job.answers == [job.seq] for job in jobs)


@pytest.mark.parametrize("first", [torch.OutOfMemoryError("the pass of four (fake)"), None])
def test_a_failed_prefill_runs_in_halves_and_only_the_job_that_fails_alone_fails(first) -> None:
    """One job's own failure (or the pass out of memory first) fails only that job: the pass runs
    again in halves (worker/batch/oom.py's one policy), the other jobs join in two passes."""
    batch = FakeBatch({1: first} if first is not None else {})
    jobs = [Job(FakeSeq(10, 3)) for _ in range(4)]
    admit = batch.admit_many

    def poisoned(seqs: list[FakeSeq]) -> None:
        if jobs[2].seq in seqs:
            batch._maybe_fail()  # out of memory first, when `first` is
            raise Injected("the third job's own prefill fails")
        admit(seqs)

    batch.admit_many = poisoned  # type: ignore[method-assign]
    core = EngineCore(FakeServed(batch), max_batch=8, wait_s=0.05)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert batch.prefills == [2, 1]  # the first half whole; of the second, the fourth alone
    assert [job.answers == [job.seq] for job in jobs] == [True, True, False, True]
    assert isinstance(jobs[2].answers[0], Injected) and len(jobs[2].answers) == 1
    assert all(job.starts == 1 for job in jobs)


def test_a_long_prompt_is_fed_in_chunks_between_the_running_batch_s_steps() -> None:
    batch = FakeBatch(chunk_tokens=100)
    running = [Job(FakeSeq(10, 200))]  # decodes until after the last chunk
    core = EngineCore(FakeServed(batch), max_batch=4)  # type: ignore[arg-type]
    for entry in entries(running):
        core.submit(entry)
    core.tick(batch)  # type: ignore[arg-type]  # the short job prefills and steps
    long = [Job(FakeSeq(450, 0)), Job(FakeSeq(250, 5))]  # a trace in 5 chunks, a generation in 3
    for entry in entries(long):
        core.submit(entry)
    run(core, batch, [*running, *long])
    assert all(job.answers == [job.seq] for job in [*running, *long])
    # never two chunks without a decoding step between them while the short job runs
    assert "chunk,chunk" not in ",".join(batch.log)
    assert batch.log.count("chunk") == 5 + 3
    assert all(job.starts == 1 for job in long) and "trace" not in batch.log


def test_jobs_in_chunks_count_against_the_batch_and_fail_alone() -> None:
    batch = FakeBatch(chunk_tokens=100)
    feed, chunks = batch.feed, [0]

    def failing(item, most: int) -> bool:
        chunks[0] += 1
        if chunks[0] == 2:
            raise Injected("the second chunk")
        return feed(item, most)

    batch.feed = failing  # type: ignore[method-assign]
    jobs = [Job(FakeSeq(10, 20)), Job(FakeSeq(300, 4)), Job(FakeSeq(10, 3))]
    core = EngineCore(FakeServed(batch), max_batch=2, wait_s=0.05)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert isinstance(jobs[1].answers[0], Injected)  # the long one failed at its second chunk
    assert jobs[0].answers == [jobs[0].seq] and jobs[2].answers == [jobs[2].seq]
    assert batch.largest <= 2 and not core.scheduler.active and not core.scheduler.feeding


def test_traces_that_need_every_logit_never_share_a_pass_with_those_that_do_not() -> None:
    batch = FakeBatch()
    scored = [Job(FakeSeq(100, 0, scores=object())) for _ in range(2)]  # type: ignore[arg-type]
    plain = [Job(FakeSeq(100, 0)) for _ in range(3)]
    core = EngineCore(FakeServed(batch), max_batch=8, wait_s=0.05)  # type: ignore[arg-type]
    seen: list[list[bool]] = []
    original = batch.trace

    def trace(seqs: list[FakeSeq]) -> None:
        seen.append([s.scores is not None for s in seqs])
        original(seqs)

    batch.trace = trace  # type: ignore[method-assign]
    for entry in entries([*scored, *plain]):
        core.submit(entry)
    run(core, batch, [*scored, *plain])
    assert sorted(seen) == [[False] * 3, [True] * 2]


def test_beside_decoding_jobs_prefill_work_gets_about_half_the_time(monkeypatch) -> None:
    """A chunk that takes as long as ten decoding steps is followed by ten steps: the running
    batch is owed the time the chunk took (timed with a fake clock the fake batch advances)."""
    import worker.engine.core as engine_core

    now = [0.0]
    monkeypatch.setattr(engine_core, "clock", lambda: now[0])
    batch = FakeBatch(chunk_tokens=100)
    feed, step = batch.feed, batch.step

    def slow_feed(item, most: int) -> bool:
        now[0] += 10.0
        return feed(item, most)

    def quick_step() -> list[FakeSeq]:
        now[0] += 1.0
        return step()

    batch.feed, batch.step = slow_feed, quick_step  # type: ignore[method-assign]
    running = [Job(FakeSeq(10, 60))]
    core = EngineCore(FakeServed(batch), max_batch=4)  # type: ignore[arg-type]
    for entry in entries(running):
        core.submit(entry)
    core.tick(batch)  # type: ignore[arg-type]
    long = [Job(FakeSeq(400, 0))]  # four chunks
    for entry in entries(long):
        core.submit(entry)
    run(core, batch, [*running, *long])
    order = ",".join(batch.log)
    assert "chunk," + ",".join(["step"] * 10) + ",chunk" in order
    assert ",".join(["step"] * 11) + ",chunk" not in order  # and not more than its share


def _noting(jobs: list[Job], order: list[Job]) -> list[Entry]:
    """`entries(jobs)` whose answers are also noted in `order`, as they come."""
    made = entries(jobs)
    for job, entry in zip(jobs, made, strict=True):
        entry.done = lambda outcome, job=job: (job.answers.append(outcome), order.append(job))  # type: ignore[misc]
    return made


def _arriving_during_chunks(
    batch: FakeBatch, core: EngineCore, arrivals: dict[int, list[Job]], order: list[Job]
) -> None:
    """Submit `arrivals[n]` while the n-th chunk is fed (the engine is busy with a long prompt)."""
    feed, chunks = batch.feed, [0]

    def feeding(item, most: int) -> bool:
        chunks[0] += 1
        for entry in _noting(arrivals.get(chunks[0], []), order):
            core.submit(entry)
        return feed(item, most)

    batch.feed = feeding  # type: ignore[method-assign]


def test_a_short_job_that_arrives_while_a_long_prompt_is_fed_waits_for_one_chunk_not_the_prompt() -> None:
    """Issue 47: a 5.3k-token prompt made another key's 4-token job, sent 1 s later, wait for the
    whole prompt (53x its time alone). Now the short job's pass runs after the chunk in progress."""
    batch = FakeBatch(chunk_tokens=100)
    core = EngineCore(FakeServed(batch), max_batch=4)  # type: ignore[arg-type]
    long, short = Job(FakeSeq(1000, 3)), Job(FakeSeq(10, 3))  # ten chunks; a one-pass prompt
    order: list[Job] = []
    _arriving_during_chunks(batch, core, {2: [short]}, order)
    for entry in _noting([long], order):
        core.submit(entry)
    run(core, batch, [long, short])
    assert batch.log.index("prefill") == 2  # chunk 1, chunk 2 (it arrives), then its pass
    assert order == [short, long]  # it ends before the long prompt is all fed
    assert batch.log.count("chunk") == 10 and long.answers == [long.seq] and short.answers == [short.seq]


def test_short_jobs_arriving_at_every_chunk_never_starve_the_long_prompt() -> None:
    """The oldest work gets every second unit of prefill: a stream of short arrivals (one per
    chunk) delays a ten-chunk prompt by at most one unit per chunk, and each short job still
    waits for at most one chunk."""
    batch = FakeBatch(chunk_tokens=100)
    core = EngineCore(FakeServed(batch), max_batch=64)  # type: ignore[arg-type]
    long = Job(FakeSeq(1000, 1))
    shorts = {n: [Job(FakeSeq(10, 1))] for n in range(1, 11)}
    order: list[Job] = []
    _arriving_during_chunks(batch, core, shorts, order)
    for entry in _noting([long], order):
        core.submit(entry)
    every_short = [j for js in shorts.values() for j in js]
    run(core, batch, [long, *every_short])
    units = [u for u in batch.log if u in ("chunk", "prefill")]
    last_chunk = len(units) - 1 - units[::-1].index("chunk")
    assert units.count("chunk") == 10 and last_chunk < 20  # the long prompt: every second unit at least
    assert "chunk,chunk" not in ",".join(units)  # whoever arrived during a chunk went next
    assert all(job.answers == [job.seq] for job in [long, *every_short])


def test_each_turn_is_one_plan_a_unit_of_prefill_then_a_step_when_rows_decode() -> None:
    """The scheduler's plan (vLLM v1's SchedulerOutput) says what a turn runs before it runs: a
    trace joins no row (no step after it), a long text's chunks join none until its last, a pass
    of generations joins its rows; while the running batch is owed time, no prefill at all."""
    from worker.engine.scheduler import Feed, Pass, Scheduler, StepOutcome

    batch = FakeBatch(chunk_tokens=100)
    scheduler = Scheduler(lambda seq, padded: padded, max_batch=8)
    trace, long, short = (Entry(seq=s, done=lambda _: None) for s in (FakeSeq(10, 0), FakeSeq(250, 5), FakeSeq(10, 5)))
    for entry in (trace, long, short):
        scheduler.submit(entry)
    scheduler.take_in(batch, wait=False)  # type: ignore[arg-type]

    plans = [scheduler.schedule(batch) for _ in range(3)]  # type: ignore[arg-type]
    assert [type(p.prefill) for p in plans] == [Pass, Pass, Feed]  # the oldest, the fewest positions left, the oldest
    assert plans[0].prefill.entries == [trace] and plans[0].prefill.trace and not plans[0].decode  # type: ignore[union-attr]
    assert plans[1].prefill.entries == [short] and plans[1].decode  # type: ignore[union-attr]  # it joins
    assert plans[2].prefill.entry is long and not plans[2].decode  # type: ignore[union-attr]  # 100 of 250 fed
    assert not scheduler.schedule(batch).decode  # type: ignore[arg-type]  # 200 of 250: still none
    batch.rows.append(short.seq)  # the short job decodes now
    last = scheduler.schedule(batch)  # type: ignore[arg-type]
    assert isinstance(last.prefill, Feed) and last.decode  # its last chunk
    scheduler.update_from_output(last, StepOutcome(prefill_s=10.0, decode_s=1.0))
    assert scheduler.owed == 9.0
    owed = scheduler.schedule(batch)  # type: ignore[arg-type]
    assert owed.prefill is None and owed.decode  # the batch is owed: it decodes, nothing else runs
    scheduler.update_from_output(owed, StepOutcome(decode_s=4.0))
    assert scheduler.owed == 5.0
    scheduler.update_from_output(owed, StepOutcome())  # no row decoded: nothing is owed
    assert scheduler.owed == 0.0

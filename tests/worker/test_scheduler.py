"""The scheduler, against a fake batch (no model, no tensors): the memory budget and the KV cache's
room, prefill passes of similar lengths, long prompts in chunks, the time shared between prefill
and decoding, and the plan of each turn."""

from __future__ import annotations

import pytest
import torch

from tests.support.fake_batch import FakeBatch, FakeSeq, FakeServed, Injected, Job, entries, run
from worker.engine.core import EngineCore
from worker.engine.scheduler import Entry


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch) -> None:
    """The fair share times prefill work against decoding steps with the engine core's clock; on a
    busy machine a fake chunk preempted for 100 ms was owed thousands of fake steps, and the plans
    these tests check came out in another order. This clock ticks once per reading: every prefill
    unit and every step takes one unit (a test that times its work otherwise sets its own)."""
    import itertools

    import worker.engine.core as engine_core

    monkeypatch.setattr(engine_core, "clock", itertools.count().__next__)


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


def test_a_burst_into_an_empty_batch_starts_together_and_a_later_job_joins_by_the_fair_share() -> None:
    """Prompts of different lengths split into several passes (padding); into an empty batch they
    all run before the first decoding step, so equal jobs start and end on the same steps. Once the
    batch decodes, a job that arrives is planned by the fair share: its pass, then a step."""
    from worker.engine.scheduler import Pass, Scheduler, StepOutcome

    batch = FakeBatch()
    scheduler = Scheduler(lambda seq, padded: padded, max_batch=8)
    burst = [Entry(seq=FakeSeq(n, 5), done=lambda _: None) for n in (10, 10, 20, 20, 40, 40)]
    for entry in burst:
        scheduler.submit(entry)
    scheduler.take_in(batch, wait=False)  # type: ignore[arg-type]
    plans = []
    while scheduler.waiting:
        plan = scheduler.schedule(batch)  # type: ignore[arg-type]
        assert isinstance(plan.prefill, Pass)
        batch.rows.extend(entry.seq for entry in plan.prefill.entries)  # they join
        plans.append(plan)
        scheduler.update_from_output(plan, StepOutcome(prefill_s=1.0, decode_s=1.0 if plan.decode else None))
    assert len(plans) == 3  # by length: padding splits them
    assert [plan.decode for plan in plans] == [False, False, True]  # the first step decodes all six
    assert scheduler.owed == 0.0  # nothing decoded during the burst: nothing owed for it

    late = Entry(seq=FakeSeq(10, 5), done=lambda _: None)
    scheduler.submit(late)
    scheduler.take_in(batch, wait=False)  # type: ignore[arg-type]
    joins = scheduler.schedule(batch)  # type: ignore[arg-type]
    assert isinstance(joins.prefill, Pass) and joins.prefill.entries == [late] and joins.decode
    scheduler.update_from_output(joins, StepOutcome(prefill_s=3.0, decode_s=1.0))
    assert scheduler.owed == 2.0  # its pass is owed to the running rows again


def test_equal_jobs_in_a_burst_decode_in_full_steps_through_the_engine_core() -> None:
    """The engine core with the scheduler: 24 equal jobs of three prompt lengths (three passes) at
    a batch of 8 run in three waves of full steps, no wave staggered by the passes it was split in."""
    batch = FakeBatch()
    jobs = [Job(FakeSeq(10 * (1 + i % 3), 6)) for i in range(24)]
    core = EngineCore(FakeServed(batch), max_batch=8)  # type: ignore[arg-type]
    for entry in entries(jobs):
        core.submit(entry)
    run(core, batch, jobs)
    assert all(job.answers == [job.seq] for job in jobs)
    assert batch.log.count("step") == 3 * 5  # each wave: its first token from its passes, then 5 full steps

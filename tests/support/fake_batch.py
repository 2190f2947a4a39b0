"""A fake running batch for the engine core and its scheduler (tests/worker/test_engine_core.py,
tests/worker/test_scheduler.py): the decoder's contract without a model or tensors, with failures
injected by call number."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import torch

from worker.engine.core import EngineCore
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

"""What trusted nnsight code prints (worker/nnsight/jobs.py): its lines reach its job as LOG
statuses, from its own thread and from threads it starts, bounded in number and length; printing
without newlines keeps at most one cut line in memory; threads left printing after their job
ended reach the worker's log only up to a bound. Real threads, the real stdout router."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Iterator

from worker.nnsight import jobs as nnsight_jobs
from worker.nnsight.jobs import MAX_LOG_LINE, MAX_LOG_LINES, STRAY_BYTES, _printed_to


@contextlib.contextmanager
def worker_log() -> Iterator[io.StringIO]:
    """The process's stdout as the worker's log, with actq's router installed over it (in the
    test's body: pytest sets sys.stdout again between a fixture and the test)."""
    saved, sys.stdout = sys.stdout, nnsight_jobs._ThreadStdout(io.StringIO())
    try:
        yield sys.stdout.original
    finally:
        sys.stdout = saved


def test_a_thread_the_job_starts_prints_to_the_job_not_the_workers_log():
    """Issue 47: a background thread's prints went to the worker's log (200 MB)."""
    emitted: list[str] = []
    with worker_log() as log, _printed_to(emitted.append):
        print("from the job")
        thread = threading.Thread(target=lambda: [print(f"thread {i}") for i in range(5000)])
        thread.start()
        thread.join()
    assert emitted[0] == "from the job" and emitted[1:5] == [f"thread {i}" for i in range(4)]
    assert len(emitted) == MAX_LOG_LINES + 1 and "the rest are dropped" in emitted[-1]
    assert log.getvalue() == ""


def test_a_thread_left_printing_after_its_job_reaches_the_log_only_up_to_a_bound():
    with worker_log() as log:
        with _printed_to(lambda line: None):
            pass
        chunk = "x" * 4096
        for _ in range(STRAY_BYTES // len(chunk) * 3):  # three times the bound, after the job ended
            print(chunk, end="")
    written = log.getvalue()
    assert STRAY_BYTES <= len(written) <= STRAY_BYTES + 200 and written.endswith("the rest are dropped)\n")


def test_printing_without_newlines_keeps_one_cut_line():
    """Printing without newlines was quadratic: every write searched everything pending."""
    emitted: list[str] = []
    with worker_log(), _printed_to(emitted.append):
        sink = nnsight_jobs._router().current
        assert sink is not None
        for i in range(200_000):
            print(str(i % 10), end="")
            assert sink.size <= MAX_LOG_LINE
        print("\nnext")
    assert emitted == ["".join(str(i % 10) for i in range(MAX_LOG_LINE)), "next"]

"""worker/results/store_writes.py: jobs that write to the store finish on a pool of their own, and capture
jobs wait to join a batch while too many jobs' files wait to be stored. Real threads; a store
write that cannot finish is an event the test holds shut."""

from __future__ import annotations

import threading

from worker.results.store_writes import StoreWrites


def test_a_write_held_up_delays_neither_another_write_nor_a_capture_job_under_the_limit():
    pool = StoreWrites(backlog_limit=2, threads=4)
    store_down, second_done, joined = threading.Event(), threading.Event(), threading.Event()
    pool.submit(store_down.wait, 30)
    pool.submit(second_done.set)  # not queued behind the first
    assert second_done.wait(10)
    pool.admit("job-a", joined.set)  # one write waiting, the limit is 2: it joins at once
    assert joined.is_set() and pool.held == 0
    store_down.set()


def test_capture_jobs_past_the_backlog_wait_in_order_and_join_as_writes_end():
    pool = StoreWrites(backlog_limit=2, threads=4)
    store_down = threading.Event()
    for _ in range(2):
        pool.submit(store_down.wait, 30)
    order: list[str] = []
    joined = threading.Event()

    def join(name: str):
        def run() -> None:
            order.append(name)
            if len(order) == 2:
                joined.set()

        return run

    pool.admit("job-a", join("a"))
    pool.admit("job-b", join("b"))
    assert order == [] and pool.held == 2 and pool.backlog == 2
    store_down.set()  # both writes end (stored, or failed past the outage window)
    assert joined.wait(10)
    assert order == ["a", "b"] and pool.held == 0


def test_the_wait_is_logged_with_its_reason(caplog):
    pool = StoreWrites(backlog_limit=1, threads=2)
    store_down = threading.Event()
    pool.submit(store_down.wait, 30)
    with caplog.at_level("WARNING"):
        pool.admit("job-x", lambda: None)
    assert "job job-x waits to join a batch: the files of 1 jobs are waiting to be stored" in caplog.text
    store_down.set()

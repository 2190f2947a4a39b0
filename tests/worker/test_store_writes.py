"""worker/results/store_writes.py: jobs that write to the store finish on a pool of their own, and capture
jobs wait to join a batch while too many jobs' files, or too many of their bytes, wait to be
stored. Real threads; a store write that cannot finish is an event the test holds shut."""

from __future__ import annotations

import threading

from worker.results.store_writes import Backlog, StoreWrites

MIB = 1 << 20


def _joins(order: list[str], name: str, all_in: threading.Event, expected: int):
    def run() -> None:
        order.append(name)
        if len(order) == expected:
            all_in.set()

    return run


def test_a_write_held_up_delays_neither_another_write_nor_a_capture_job_under_the_limit():
    pool = StoreWrites(Backlog(jobs=2, bytes=64 * MIB), threads=4)
    store_down, second_done, joined = threading.Event(), threading.Event(), threading.Event()
    pool.submit(MIB, store_down.wait, 30)
    pool.submit(MIB, second_done.set)  # not queued behind the first
    assert second_done.wait(10)
    pool.admit("job-a", joined.set, MIB)  # one write waiting, the limit is 2: it joins at once
    assert joined.is_set() and pool.held == 0
    store_down.set()


def test_capture_jobs_past_the_backlog_wait_in_order_and_join_as_writes_end():
    pool = StoreWrites(Backlog(jobs=2, bytes=64 * MIB), threads=4)
    store_down = threading.Event()
    for _ in range(2):
        pool.submit(MIB, store_down.wait, 30)
    order: list[str] = []
    joined = threading.Event()
    pool.admit("job-a", _joins(order, "a", joined, 2), MIB)
    pool.admit("job-b", _joins(order, "b", joined, 2), MIB)
    assert order == [] and pool.held == 2 and pool.backlog == 2
    store_down.set()  # both writes end (stored, or failed past the outage window)
    assert joined.wait(10)
    assert order == ["a", "b"] and pool.held == 0


def test_a_healthy_burst_of_a_whole_batch_holds_nothing_back():
    """32 small jobs ending at one step (a batch of 32) wait for their writes; the next batch's
    capture jobs still join at once (the old limit of 8 jobs held them)."""
    pool = StoreWrites(Backlog(jobs=64, bytes=1 << 30), threads=32)
    writing = threading.Event()
    for _ in range(32):
        pool.submit(2 * MIB, writing.wait, 30)
    joined: list[str] = []
    for i in range(32):
        pool.admit(f"job-{i}", lambda i=i: joined.append(f"job-{i}"), 2 * MIB)
    assert len(joined) == 32 and pool.held == 0 and pool.backlog_bytes == 64 * MIB
    writing.set()


def test_bytes_waiting_hold_capture_jobs_under_the_jobs_limit():
    pool = StoreWrites(Backlog(jobs=100, bytes=10 * MIB), threads=8)
    stores = [threading.Event() for _ in range(3)]
    for store in stores:
        pool.submit(3 * MIB, store.wait, 30)  # 9 MiB waiting
    order: list[str] = []
    first, rest = threading.Event(), threading.Event()
    pool.admit("job-a", _joins(order, "a", first, 1), 2 * MIB)  # 9 + 2 > 10: held
    pool.admit("job-b", _joins(order, "b", rest, 2), 2 * MIB)  # behind it, in order
    assert order == [] and pool.held == 2 and pool.backlog == 3 and pool.backlog_bytes == 9 * MIB
    stores[0].set()  # 6 MiB waiting: a fits (8), then b (10, the limit itself)
    assert first.wait(10) and rest.wait(10)
    assert order == ["a", "b"] and pool.held == 0
    stores[1].set()
    stores[2].set()


def test_a_release_stops_at_the_bytes_limit():
    pool = StoreWrites(Backlog(jobs=100, bytes=10 * MIB), threads=8)
    big, small = threading.Event(), threading.Event()
    pool.submit(6 * MIB, big.wait, 30)
    pool.submit(4 * MIB, small.wait, 30)  # 10 MiB waiting: at the limit
    order: list[str] = []
    two_in, three_in = threading.Event(), threading.Event()

    def join(name: str):
        def run() -> None:
            order.append(name)
            (two_in if len(order) == 2 else three_in if len(order) == 3 else threading.Event()).set()

        return run

    for name in "abc":
        pool.admit(f"job-{name}", join(name), 3 * MIB)
    assert pool.held == 3
    big.set()  # 4 MiB waiting: a (7) and b (10) fit, c (13) does not
    assert two_in.wait(10)
    assert order == ["a", "b"] and pool.held == 1
    small.set()  # 0 waiting: c joins
    assert three_in.wait(10)
    assert order == ["a", "b", "c"] and pool.held == 0


def test_a_job_larger_than_the_bytes_limit_joins_once_nothing_else_waits():
    pool = StoreWrites(Backlog(jobs=8, bytes=MIB), threads=2)
    store_down, joined = threading.Event(), threading.Event()
    pool.admit("job-alone", joined.set, 5 * MIB)  # nothing waits: it joins, whatever its size
    assert joined.is_set()
    pool.submit(5 * MIB, store_down.wait, 30)
    later = threading.Event()
    pool.admit("job-later", later.set, 5 * MIB)
    assert not later.is_set() and pool.held == 1
    store_down.set()
    assert later.wait(10) and pool.held == 0


def test_the_wait_is_logged_with_its_reason(caplog):
    pool = StoreWrites(Backlog(jobs=1, bytes=1 << 30), threads=2)
    store_down = threading.Event()
    pool.submit(3 * MIB, store_down.wait, 30)
    with caplog.at_level("WARNING"):
        pool.admit("job-x", lambda: None, MIB)
    assert (
        "job job-x waits to join a batch: the files of 1 jobs are waiting to be stored (3.0 MiB; "
        "ACTQ_STORAGE_BACKLOG_JOBS=1, ACTQ_STORAGE_BACKLOG_BYTES=1073741824)" in caplog.text
    )
    store_down.set()

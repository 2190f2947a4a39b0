"""The Celery worker's task threads: one per job it holds in its engine, a batch's worth and the
jobs ready to take a place as it frees (ACTQ_READY_JOBS), and a batch's worth more for jobs
writing their files (worker/storing_room.py), read from the environment as a deployed worker
reads it; and the prefetch kept at the places plus the jobs storing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kombu.common import QoS

from shared.settings import Settings
from worker.storing_room import StoringRoom

ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_worker_holds_a_batch_the_ready_jobs_and_room_for_a_batch_storing():
    from worker.celery_app import places, task_threads

    assert places(Settings(max_batch=32)) == 32  # none ready by default
    assert task_threads(Settings(max_batch=32)) == 64
    assert task_threads(Settings(max_batch=1)) == 2
    assert places(Settings(max_batch=32, ready_jobs=8)) == 40
    assert task_threads(Settings(max_batch=4, ready_jobs=12)) == 20


def test_the_celery_app_takes_its_concurrency_from_the_environment():
    check = "import worker.celery_app as c; print(c.app.conf.worker_concurrency, c.storing_room.room)"
    env = {**os.environ, "ACTQ_MAX_BATCH": "8", "ACTQ_READY_JOBS": "5"}
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "21 8"


class _Consumer:
    """What the room reads of Celery's consumer: its kombu QoS (real)."""

    def __init__(self, threads: int) -> None:
        self.applied: list[int] = []
        self.qos = QoS(lambda prefetch_count: self.applied.append(prefetch_count), threads)
        self.qos.update()


def test_the_prefetch_is_the_places_plus_the_jobs_storing_at_most_the_room():
    room = StoringRoom(places=4, room=4)
    consumer = _Consumer(threads=4 + 4)
    room.attach(consumer, running=set())
    assert consumer.qos.value == 4 and consumer.applied[-1] == 4
    for _ in range(6):  # six jobs left their batch to be stored: four more messages, no more
        room.changed(1)
    assert room.storing == 6 and consumer.qos.value == 8
    room.changed(-1)  # one of them stored: still four past the room's limit of extra fetches
    assert consumer.qos.value == 8
    for _ in range(5):
        room.changed(-1)
    assert room.storing == 0 and consumer.qos.value == 4


def test_a_consumer_started_again_leaves_room_for_the_tasks_still_running():
    """After a lost connection, the tasks still running hold messages of the old connection: the
    new one fetches that many fewer, and one more as each ends (Celery's own reduction would
    end at the pool's 8 threads and keep them: prefetch_count_reduction is off)."""
    room = StoringRoom(places=4, room=4)
    room.attach(_Consumer(threads=8), running=set())
    room.changed(1)
    room.changed(1)  # two jobs storing
    room.detach()  # the connection was lost: they go on storing, with a third task running
    again = _Consumer(threads=8)
    room.attach(again, running={"t1", "t2", "t3"})
    assert again.qos.value == 4 + 2 - 3
    room.task_ended("t3")
    assert again.qos.value == 4
    room.changed(-1)
    room.task_ended("t1")  # a storing job ended: its task too
    assert again.qos.value == 4 + 1 - 1
    room.changed(-1)
    room.task_ended("t2")
    room.task_ended("t4")  # a task of the new connection: nothing carried
    assert again.qos.value == 4 and room.storing == 0

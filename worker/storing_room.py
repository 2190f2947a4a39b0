"""Room in the worker's task threads for jobs whose files are being written.

A task thread holds its job until the job ends, files and outcome written, so that its message
is acknowledged only then (late ack). A capture job's batch place is free as soon as it is
decoded, but its thread was not: when a batch of capture jobs ended together, no new message was
fetched until their files were stored, and the engine idled meanwhile (bench/bench_bulk.py: the
"claimed" phase of the capture arm); with the store away (an S3 outage), jobs that capture
nothing could not even be fetched.

So the pool has a batch's worth (ACTQ_MAX_BATCH: the room) more threads than places, and the
consumer's prefetch is kept at the places (ACTQ_MAX_BATCH + ACTQ_READY_JOBS) plus the jobs that
are storing now, at most the room: one more message is fetched for each job that leaves its batch
to be stored (the engine says so: `{"storing": JOB_ID}`, worker/engine_client.py) and one fewer
when it ends. A worker with nothing storing reserves no more messages than its places, so other
workers still get the queue's jobs. Prefetch changes go through kombu's QoS, applied by the
consumer's own loop (as Celery's ETA tasks do). A consumer started again after a lost connection
leaves room for the tasks still running from before (their messages came on the old connection)
and gives it back as each ends: Celery's own reduction does that for a fixed prefetch, and would
restore the whole pool's threads, so it is off (worker/celery_app.py)."""

from __future__ import annotations

import threading
from typing import Any

from celery import bootsteps
from celery.worker import state


class StoringRoom:
    """The consumer's prefetch: `places`, plus the jobs storing now (at most `room`), less the
    tasks still running from before the consumer last started."""

    def __init__(self, places: int, room: int) -> None:
        self.places, self.room = places, room
        self._lock = threading.Lock()
        self._storing = 0
        self._carried: set[str] = set()  # tasks running since before the consumer started (re)
        self._qos: Any = None  # the consumer's kombu QoS, while it runs
        self._applied = 0  # the prefetch this room last set (or found) on it

    @property
    def storing(self) -> int:
        return self._storing

    @property
    def prefetch(self) -> int:
        """The prefetch the room asks for now."""
        return max(1, self.places + min(self._storing, self.room) - len(self._carried))

    def changed(self, delta: int) -> None:
        """A job began storing (+1) or, having begun, ended (-1)."""
        with self._lock:
            self._storing += delta
            self._apply()

    def task_ended(self, task_id: str) -> None:
        """A task ended: one carried over a reconnection leaves its message's room to a new one."""
        with self._lock:
            if task_id in self._carried:
                self._carried.discard(task_id)
                self._apply()

    def attach(self, consumer: Any, running: set[str]) -> None:
        """The consumer started, or started again after a lost connection, with `running` tasks
        still holding their jobs (their messages were fetched on the old connection): its prefetch
        leaves room for them until they end (as Celery's own reduction would, which is off:
        worker/celery_app.py), then comes back to the places and the jobs storing."""
        with self._lock:
            self._qos, self._carried = consumer.qos, set(running)
            self._applied = consumer.qos.value
            self._apply()
            self._qos.update()  # before the consumer's loop fetches its first message

    def detach(self) -> None:
        with self._lock:
            self._qos = None

    def _apply(self) -> None:
        if self._qos is None:
            return
        by, self._applied = self.prefetch - self._applied, self.prefetch
        if by > 0:
            self._qos.increment_eventually(by)
        elif by < 0:
            self._qos.decrement_eventually(-by)


def consumer_step(room: StoringRoom) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep that hands `room` the task consumer's QoS once it is made."""

    class StoringRoomStep(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, c: Any) -> None:
            room.attach(c, {request.id for request in list(state.active_requests)})

        def stop(self, c: Any) -> None:
            room.detach()

        def shutdown(self, c: Any) -> None:
            room.detach()

    return StoringRoomStep

"""Room in the worker's task threads for jobs whose files are being written.

A task thread holds its job until the job ends, files and outcome written, so that its message
is acknowledged only then (late ack). A capture job's batch place is free as soon as it is
decoded, but its thread was not: when a batch of capture jobs ended together, no new message was
fetched until their files were stored, and the engine idled meanwhile (bench/bench_bulk.py: the
"claimed" phase of the capture arm); with the store away (an S3 outage), jobs that capture
nothing could not even be fetched.

So the pool has `ROOM` (a batch's worth, ACTQ_MAX_BATCH) more threads than places, and the
consumer's prefetch is kept at the places (ACTQ_MAX_BATCH + ACTQ_READY_JOBS) plus the jobs that
are storing now, at most `ROOM`: one more message is fetched for each job that leaves its batch
to be stored (the engine says so: `{"storing": JOB_ID}`, worker/engine_client.py) and one fewer
when it ends. A worker with nothing storing reserves no more messages than its places, so other
workers still get the queue's jobs. Prefetch changes go through kombu's QoS, applied by the
consumer's own loop (as Celery's ETA tasks do); a reconnected consumer starts again from the
places and the jobs storing then."""

from __future__ import annotations

import threading
from typing import Any

from celery import bootsteps


class StoringRoom:
    """The jobs storing now, and the prefetch above the places they are given."""

    def __init__(self, room: int) -> None:
        self.room = room
        self._lock = threading.Lock()
        self._storing = 0
        self._qos: Any = None  # the consumer's kombu QoS, while it runs

    @property
    def storing(self) -> int:
        return self._storing

    @property
    def extra(self) -> int:
        """Messages fetched beyond the places now: one per job storing, at most `room`."""
        return min(self._storing, self.room)

    def changed(self, delta: int) -> None:
        """A job began storing (+1) or, having begun, ended (-1)."""
        with self._lock:
            before = self.extra
            self._storing += delta
            self._adjust(self.extra - before)

    def attach(self, consumer: Any) -> None:
        """The consumer started (or started again after a reconnection) with a prefetch of the
        pool's threads: down to the places, plus the jobs storing now."""
        with self._lock:
            self._qos = consumer.qos
            consumer.initial_prefetch_count = max(1, consumer.initial_prefetch_count - self.room)
            self._adjust(self.extra - self.room)
            self._qos.update()  # before the consumer's loop fetches its first message

    def detach(self) -> None:
        with self._lock:
            self._qos = None

    def _adjust(self, by: int) -> None:
        if self._qos is None or by == 0:
            return
        if by > 0:
            self._qos.increment_eventually(by)
        else:
            self._qos.decrement_eventually(-by)


def consumer_step(room: StoringRoom) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep that hands `room` the task consumer's QoS once it is made."""

    class StoringRoomStep(bootsteps.StartStopStep):
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, c: Any) -> None:
            room.attach(c)

        def stop(self, c: Any) -> None:
            room.detach()

        def shutdown(self, c: Any) -> None:
            room.detach()

    return StoringRoomStep

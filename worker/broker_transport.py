"""kombu's Redis transport with two repairs, so a worker survives Redis going away under load.

When the consumer loses its broker connection, Celery (5.7) collects and then closes the old
kombu connection. Closing it first drops the transport's back-reference to its connection
(`Transport.client = None`); if the old channel still had a BRPOP in flight, its close is
finished by the second call, and that call restores the channel's unacknowledged messages
through a new connection pool whose parameters it reads from `Transport.client`: AttributeError,
which Celery does not count as a connection error, so the worker stops with "Unrecoverable
error". The same happens later to every late ack of a message delivered on the old channel.
With a batch of jobs in flight the consumer is almost always fetching, so a Redis restart hit
this about one time in three (tests/e2e/test_outages.py).

The repair: a channel remembers the connection parameters it was built with and uses them once
the transport has forgotten them. Restoring or acknowledging then talks to Redis like any other
call: it succeeds once Redis is back, or fails with a connection error that kombu and Celery
handle (a message left unacknowledged is redelivered after the visibility timeout, and its
job's record says whether it still has to run). Selected with Celery's `broker_transport`.

The second: an acknowledgement that fails because Redis is down. kombu's QoS removes the message
from Redis's unacked index first and frees the consumer's prefetch slot only if that worked, so a
failed ack keeps its slot for good. A consumer whose slots were all taken was not fetching, so it
never noticed the outage and never reconnected: with every slot lost it silently stopped taking
jobs (CI: 191 of 200 jobs left queued after a Redis restart, no error in the worker's log). Here an
ack retries through an outage of up to `ack_outage_seconds` (the worker's ACTQ_REDIS_OUTAGE_SECONDS;
acks run on the task's own thread, which would wait that long to record its outcome anyway) and
frees the slot whatever happens; an ack that still fails leaves the message to be redelivered after
the visibility timeout, when its job's record says it has finished.
"""

from __future__ import annotations

from typing import Any

import redis
import stamina
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual


class QoS(kombu_redis.QoS):
    def _retrying(self) -> Any:
        return stamina.retry_context(
            on=(redis.ConnectionError, redis.TimeoutError),
            attempts=None,
            timeout=self.channel.ack_outage_seconds,
            wait_initial=0.1,
            wait_max=2.0,
        )

    def ack(self, delivery_tag: str) -> None:
        try:
            if not self.channel.ack_outage_seconds:
                self._remove_from_indices(delivery_tag).execute()
                return
            for attempt in self._retrying():
                with attempt:
                    self._remove_from_indices(delivery_tag).execute()
        finally:
            virtual.QoS.ack(self, delivery_tag)  # the prefetch slot, freed whatever happened

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:  # restoring is not idempotent (read, then push): no retry, but the slot is freed
            try:
                self.restore_by_tag(delivery_tag, leftmost=True)
            finally:
                virtual.QoS.ack(self, delivery_tag)
        else:
            self.ack(delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS
    ack_outage_seconds: float = 0
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "ack_outage_seconds")  # type: ignore[assignment]
    _saved_connparams: dict[bool, dict[str, Any]]

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        saved = self.__dict__.setdefault("_saved_connparams", {})
        if self.connection.client is not None:
            saved[asynchronous] = super()._connparams(asynchronous=asynchronous)
        elif asynchronous not in saved:  # never connected: nothing to remember
            return super()._connparams(asynchronous=asynchronous)
        return dict(saved[asynchronous])


class Transport(kombu_redis.Transport):
    Channel = Channel

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

The third: Redis refusing writes while it runs (MISCONF: it cannot write its append-only file,
e.g. a full disk; OOM: `maxmemory` under noeviction; READONLY: it became a replica). kombu sees
these as plain ResponseErrors, which Celery does not count as connection errors: the worker died
with "Unrecoverable error: ... MISCONF" on the ZADD that records a delivered message in
`unacked_index` (issue 22). Here every broker connection raises a refusal as `WritesRefused`, a
redis ConnectionError: kombu and Celery then handle it as they handle Redis going away (the
consumer reconnects, retrying until Redis accepts writes again, and the worker stays up). The
record of a message just delivered (BRPOP, which OOM does not refuse, then ZADD + HSET into
`unacked`) is retried through the refusal like an ack, so the message is not dropped; if the
refusal outlasts `ack_outage_seconds` the message is lost from Redis and its job, still queued,
is sent again by the lost-message check (worker/lost_messages.py).
"""

from __future__ import annotations

from typing import Any

import redis
import stamina
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from shared.redis_faults import WritesRefused, refusal

_REFUSING: dict[type, type] = {}


def refusals_as_connection_errors(connection_class: type) -> type:
    """`connection_class` whose replies raise a write refusal as WritesRefused (a ConnectionError)."""
    if connection_class not in _REFUSING:

        class Refusing(connection_class):
            def read_response(self, *args: Any, **kwargs: Any) -> Any:
                try:
                    return super().read_response(*args, **kwargs)
                except redis.ResponseError as exc:
                    why = refusal(exc)
                    if why is None:
                        raise
                    raise WritesRefused(f"Redis refuses writes: {why}") from exc

        Refusing.__name__ = Refusing.__qualname__ = f"Refusing{connection_class.__name__}"
        _REFUSING[connection_class] = Refusing
    return _REFUSING[connection_class]


class QoS(kombu_redis.QoS):
    def _retrying(self) -> Any:
        return stamina.retry_context(
            on=(redis.ConnectionError, redis.TimeoutError),
            attempts=None,
            timeout=self.channel.ack_outage_seconds,
            wait_initial=0.1,
            wait_max=2.0,
        )

    def append(self, message: Any, delivery_tag: str) -> None:
        """Record a delivered message in `unacked`; a write refusal is waited out (see above)."""
        if not self.channel.ack_outage_seconds:
            super().append(message, delivery_tag)
            return
        retrying = stamina.retry_context(
            on=WritesRefused, attempts=None, timeout=self.channel.ack_outage_seconds, wait_initial=0.1, wait_max=2.0
        )
        for attempt in retrying:
            with attempt:
                super().append(message, delivery_tag)

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
            saved[asynchronous] = self._refusing(super()._connparams(asynchronous=asynchronous))
        elif asynchronous not in saved:  # never connected: nothing to remember
            return self._refusing(super()._connparams(asynchronous=asynchronous))
        return dict(saved[asynchronous])

    @staticmethod
    def _refusing(params: dict[str, Any]) -> dict[str, Any]:
        params["connection_class"] = refusals_as_connection_errors(params["connection_class"])
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel

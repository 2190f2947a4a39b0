"""kombu's Redis transport with one repair, so a worker survives Redis going away under load.

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
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):
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

"""The worker's Redis transport (worker/broker_transport.py) against a real Redis that goes away
while a consumer has an unacknowledged message and a BRPOP in flight, replaying what Celery's
consumer does on a lost connection: collect the old connection, close it, reconnect."""

from __future__ import annotations

import threading

import pytest
import redis
from kombu import Connection, Queue
from kombu.common import ignore_errors
from kombu.transport import redis as kombu_redis

from worker.broker_transport import Transport

QUEUE = "actq.transport-test"


def _lose_connection_mid_fetch(url: str, transport: type, server) -> tuple[Connection, list]:
    """Deliver messages on two channels without acking them, leave a BRPOP waiting, stop Redis, and
    collect and close the connection as Celery's consumer does. Returns the closed connection and
    the unacknowledged messages."""
    conn = Connection(url, transport=transport)
    queue = Queue(QUEUE, routing_key=QUEUE)
    with conn.Producer() as producer:
        producer.publish({"n": 1}, routing_key=QUEUE, declare=[queue])
        producer.publish({"n": 2}, routing_key=QUEUE, declare=[queue])
    got: list = []
    consumer = conn.Consumer(queue, callbacks=[lambda _body, message: got.append(message)], prefetch_count=2)
    consumer.consume()
    conn.drain_events(timeout=5)
    conn.drain_events(timeout=5)
    # A second channel, created later and so closed first, that also holds an unacked message:
    # its close fails while Redis is down and the transport gives up on the channels after it.
    other, side = conn.channel(), Queue(f"{QUEUE}.other", routing_key=f"{QUEUE}.other")
    with conn.Producer(other) as producer:
        producer.publish({"n": 3}, routing_key=side.name, declare=[side])
    conn.Consumer(side, channel=other, callbacks=[lambda _body, message: got.append(message)]).consume()
    conn.drain_events(timeout=5)
    channel = conn.default_channel
    channel._brpop_start()  # the queue is empty: a BRPOP waits, as in Celery's event loop
    assert len(got) == 3 and channel._in_poll
    got[1].ack()
    server.stop()  # SIGTERM
    try:
        conn.collect(socket_timeout=1)
    except Exception:  # noqa: BLE001 - Celery ignores whatever collect raises
        pass
    ignore_errors(conn, conn.close)  # Celery: connection errors are ignored, anything else is fatal
    return conn, [got[0], got[2]]


def test_a_lost_connection_with_a_fetch_in_flight_closes_cleanly_and_acks_after_redis_returns(own_redis):
    conn, unacked = _lose_connection_mid_fetch(own_redis.url, Transport, own_redis)
    own_redis.start()  # same port, append-only file: the unacked messages are still recorded
    client = redis.Redis.from_url(own_redis.url)
    assert client.hlen("unacked") == 2
    for message in unacked:
        message.ack()  # tasks that ran through the outage acknowledge on the old channels
    assert client.hlen("unacked") == 0 and client.llen(QUEUE) == 0
    client.close()
    with Connection(own_redis.url, transport=Transport) as again:  # the consumer reconnects
        again.default_channel.client.ping()
    conn.release()


def test_kombus_own_transport_still_fails_there(own_redis):
    """Documents why the repair exists: if this starts to pass, kombu fixed it and the subclass can go."""
    with pytest.raises(AttributeError, match="hostname"):
        _lose_connection_mid_fetch(own_redis.url, kombu_redis.Transport, own_redis)


def _ack_during_outage(url: str, transport: type, server, outage: float) -> tuple[Connection, list, list]:
    """A consumer with one prefetch slot holds a message; Redis stops; the message is acked while
    Redis is down (a task that ran through the outage); Redis comes back `outage` s later.
    Returns the connection, the messages received, and what the ack raised."""
    conn = Connection(url, transport=transport, transport_options={"ack_outage_seconds": 30})
    queue = Queue(QUEUE, routing_key=QUEUE)
    with conn.Producer() as producer:
        for n in (1, 2):
            producer.publish({"n": n}, routing_key=QUEUE, declare=[queue])
    got: list = []
    conn.Consumer(queue, callbacks=[lambda _body, message: got.append(message)], prefetch_count=1).consume()
    conn.drain_events(timeout=5)
    assert len(got) == 1 and not conn.default_channel.qos.can_consume()
    server.stop()
    restart = threading.Timer(outage, server.start)
    restart.start()
    raised: list = []
    try:
        got[0].ack()
    except Exception as exc:  # noqa: BLE001 - recorded for the assertions
        raised.append(exc)
    restart.join()
    return conn, got, raised


def test_an_ack_during_an_outage_waits_for_redis_and_frees_its_prefetch_slot(own_redis):
    conn, got, raised = _ack_during_outage(own_redis.url, Transport, own_redis, outage=1.5)
    assert raised == []
    client = redis.Redis.from_url(own_redis.url)
    assert client.hlen("unacked") == 0  # the ack reached Redis once it was back
    assert client.llen(QUEUE) == 1  # the second message waits for the slot
    # The slot is free: the consumer fetches again, and its fetch on the old connection is what
    # tells Celery to reconnect.
    assert conn.default_channel.qos.can_consume()
    with pytest.raises(redis.ConnectionError):
        conn.drain_events(timeout=5)
    client.close()
    ignore_errors(conn, conn.release)


def test_kombus_own_qos_loses_the_slot_of_a_failed_ack(own_redis):
    """Documents the second repair: kombu's QoS raises and keeps the slot, so a consumer whose
    slots were all taken when Redis went away never fetches again."""
    conn, _, raised = _ack_during_outage(own_redis.url, kombu_redis.Transport, own_redis, outage=0.5)
    assert len(raised) == 1 and isinstance(raised[0], redis.ConnectionError)
    assert not conn.default_channel.qos.can_consume()
    ignore_errors(conn, conn.release)

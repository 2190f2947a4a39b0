"""The worker's Redis transport (worker/broker_transport.py) against a real Redis that refuses
writes (OOM under `maxmemory` + noeviction, READONLY after REPLICAOF): a refusal is a connection
error to kombu and Celery (they reconnect; kombu's own transport raises a ResponseError, which
stopped the worker with "Unrecoverable error"), and a delivered message's record in `unacked`
waits the refusal out instead of dropping the message."""

from __future__ import annotations

import threading

import pytest
import redis
from kombu import Connection, Queue
from kombu.common import ignore_errors
from kombu.transport import redis as kombu_redis

from shared.cli.processes import free_port
from shared.redis_faults import WritesRefused
from worker.broker_transport import Transport

QUEUE = "actq.refusal-test"


def _publish(conn: Connection) -> Queue:
    queue = Queue(QUEUE, routing_key=QUEUE)
    with conn.Producer() as producer:
        producer.publish({"n": 1}, routing_key=QUEUE, declare=[queue])
    return queue


def _refuse_oom(client: redis.Redis) -> None:
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)


def test_a_delivery_during_oom_waits_for_writes_and_keeps_the_message(own_redis):
    client = redis.Redis.from_url(own_redis.url)
    conn = Connection(own_redis.url, transport=Transport, transport_options={"ack_outage_seconds": 30})
    queue = _publish(conn)
    got: list = []
    conn.Consumer(queue, callbacks=[lambda _body, message: got.append(message)]).consume()
    _refuse_oom(client)  # BRPOP still pops (OOM spares it); recording the delivery is refused
    lift = threading.Timer(1.5, client.config_set, ("maxmemory", 0))
    lift.start()
    conn.drain_events(timeout=10)
    lift.join()
    assert len(got) == 1 and client.hlen("unacked") == 1  # recorded once writes were allowed again
    got[0].ack()
    assert client.hlen("unacked") == 0 and client.llen(QUEUE) == 0
    ignore_errors(conn, conn.release)
    client.close()


def test_kombus_own_transport_dies_on_the_refusal(own_redis):
    """Documents the repair: kombu raises the OOM reply, which Celery does not count as a
    connection error, and the popped message is gone from Redis."""
    client = redis.Redis.from_url(own_redis.url)
    conn = Connection(own_redis.url, transport=kombu_redis.Transport)
    queue = _publish(conn)
    conn.Consumer(queue, callbacks=[lambda _body, _message: None]).consume()
    _refuse_oom(client)
    try:
        with pytest.raises(redis.ResponseError) as raised:
            conn.drain_events(timeout=10)
        assert not isinstance(raised.value, tuple(conn.connection_errors))
    finally:
        client.config_set("maxmemory", 0)
    assert client.llen(QUEUE) == 0 and client.hlen("unacked") == 0
    ignore_errors(conn, conn.release)
    client.close()


def test_a_fetch_on_a_read_only_replica_is_a_connection_error(own_redis):
    client = redis.Redis.from_url(own_redis.url)
    conn = Connection(own_redis.url, transport=Transport)
    queue = _publish(conn)
    conn.Consumer(queue, callbacks=[lambda _body, _message: None]).consume()
    client.replicaof("127.0.0.1", free_port())  # BRPOP is a write: READONLY
    try:
        with pytest.raises(WritesRefused, match="READONLY") as raised:
            conn.drain_events(timeout=10)
        assert isinstance(raised.value, tuple(conn.connection_errors))  # Celery reconnects
    finally:
        client.replicaof("NO", "ONE")
    assert client.llen(QUEUE) == 1  # nothing was taken
    ignore_errors(conn, conn.release)
    with Connection(own_redis.url, transport=Transport) as again:  # the consumer reconnects
        again.default_channel.client.ping()
    client.close()

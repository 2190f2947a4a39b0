"""Find queued jobs whose broker message is lost or stranded, and send it again.

kombu's Redis transport takes a message with BRPOP, which removes it from the queue's list, and
then copies it into the `unacked` hash. Two ways a Redis outage strands a job that way:

- Redis stops between the two: its reply to BRPOP is never sent, the message is gone.
- The message reached `unacked` just before the consumer lost its connection, but never reached a
  task: Celery drops what it had not started when the connection goes, and kombu's restore of the
  old channel's messages fails while Redis is down. The message waits in `unacked` for the
  visibility timeout (2 hours by default). A test of this project saw it: 199 of 200 jobs ran after
  a Redis restart, one was delivered 4 ms before the connection loss and never started.

Either way the job stays `queued` in the store, where every queued job is in its model's queued
set. Every `interval` seconds each worker publishes the jobs its tasks hold (key with a TTL), and
one of the model's workers (a lock in Redis) looks for queued jobs older than `confirm` seconds
whose message is in neither the queue's list nor `unacked`, or is in `unacked` but held by no live
worker. A job found so at two checks at least `confirm` apart is sent again to the front of the
queue (a stranded `unacked` entry is moved back, as kombu's own restore does). A message is in
flight between BRPOP and `unacked`, or between delivery and its task, for microseconds; a worker
publishes what it holds within `interval` <= `confirm` seconds; so a job that is running or about
to run is never sent twice. A job that did run meanwhile has left the queued set.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import redis

from shared import keys

log = logging.getLogger("actq.worker")
UNACKED = "unacked"  # kombu's Redis transport: delivery tag -> [message, exchange, routing key]
UNACKED_INDEX = "unacked_index"  # delivery tag -> when delivered
SCAN_CHUNK = 1000


def _task_id(raw: bytes | str) -> str | None:
    try:
        message = json.loads(raw)
        if isinstance(message, list):  # an unacked entry
            message = message[0]
        return str(message["headers"]["id"])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _messages(client: redis.Redis, queue: str) -> Iterable[bytes | str]:
    start = 0
    while chunk := client.lrange(queue, start, start + SCAN_CHUNK - 1):
        yield from chunk
        start += SCAN_CHUNK


def held_by_live_workers(client: redis.Redis, model: str) -> set[str]:
    held: set[str] = set()
    for key in client.scan_iter(match=keys.held(model, "*"), count=SCAN_CHUNK):
        held.update(_decode(m) for m in client.smembers(key))
    return held


def find_stranded(client: redis.Redis, model: str, queue: str, min_age: float) -> dict[str, str | None]:
    """Queued jobs older than `min_age` s whose message is lost (-> None) or stranded in
    `unacked` with no live worker holding it (-> its delivery tag)."""
    waiting = cast("list[bytes]", client.zrangebyscore(keys.queued(model), "-inf", time.time() - min_age))
    if not waiting:
        return {}
    missing = {_decode(w) for w in waiting}
    for raw in _messages(client, queue):
        missing.discard(_task_id(raw) or "")
        if not missing:
            return {}
    stranded: dict[str, str | None] = dict.fromkeys(missing)
    held = held_by_live_workers(client, model)
    for tag, raw in client.hscan_iter(UNACKED, count=SCAN_CHUNK):
        job_id = _task_id(raw)
        if job_id in stranded:
            if job_id in held:
                del stranded[job_id]
            else:
                stranded[job_id] = _decode(tag)
    # A job may have left the queued set while we looked (claimed, cancelled): check again.
    return {j: tag for j, tag in stranded.items() if client.zscore(keys.queued(model), j) is not None}


class LostMessageSweeper:
    """Every `interval` s: publish what this worker holds; then, if this worker has the round,
    send again the message of each job found stranded at two checks `confirm` s apart."""

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        queue: str,
        message: Callable[[str], str],
        interval: float,
        confirm: float,
        worker_id: str = "",
        holding: Callable[[], set[str]] = set,
        held_ttl: float | None = None,
    ) -> None:
        if confirm < interval:
            raise ValueError("confirm must be at least interval: a worker publishes what it holds once per interval")
        self.client, self.model, self.queue, self.message = client, model, queue, message
        self.interval, self.confirm = interval, confirm
        self.worker_id, self.holding = worker_id, holding
        self.held_ttl = held_ttl if held_ttl is not None else 3 * interval
        self.stop = threading.Event()

    def publish_held(self) -> None:
        key = keys.held(self.model, self.worker_id)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if held := self.holding():
                pipe.sadd(key, *held)
                pipe.pexpire(key, max(1, int(self.held_ttl * 1000)))
            pipe.execute()

    def sweep(self) -> list[str]:
        """One check; returns the jobs whose message was sent again. The suspects (job id -> when
        first seen stranded) live in Redis, so any of the model's workers can confirm them."""
        if not self.client.set(keys.lost_sweep(self.model), "1", nx=True, px=max(1, int(self.interval * 900))):
            return []  # another worker checks this round
        stranded = find_stranded(self.client, self.model, self.queue, min_age=self.confirm)
        now = time.time()
        seen = {_decode(k): float(v) for k, v in self.client.hgetall(keys.lost_suspects(self.model)).items()}
        resent = sorted(j for j in stranded if j in seen and now - seen[j] >= self.confirm)  # a second sighting
        suspects = {j: seen.get(j, now) for j in stranded if j not in resent}
        with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(keys.lost_suspects(self.model))
            for job_id in resent:
                tag = stranded[job_id]
                if tag is not None:  # stranded in unacked: move it back, as kombu's restore does
                    pipe.zrem(UNACKED_INDEX, tag)
                    pipe.hdel(UNACKED, tag)
                pipe.rpush(self.queue, self.message(job_id))  # BRPOP takes from the right: it runs next
            if suspects:
                pipe.hset(keys.lost_suspects(self.model), mapping=cast("Any", suspects))
            pipe.execute()
        for job_id in resent:
            where = "no broker message" if stranded[job_id] is None else "its message stranded in unacked"
            log.warning("job %s was queued with %s (a Redis outage?): sent it again", job_id, where)
        return resent

    def round(self) -> None:
        self.publish_held()
        self.sweep()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.round()
            except redis.RedisError as exc:  # an outage: the next round tries again
                log.debug("lost-message check skipped: %s", exc)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="actq-lost-messages", daemon=True)
        thread.start()
        return thread

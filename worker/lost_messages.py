"""Find jobs whose broker message no live worker will run, and send it again.

kombu's Redis transport takes a message with BRPOP, which removes it from the queue's list, and
then copies it into the `unacked` hash, where it stays until the task acknowledges it (late ack:
when its job ends). Four ways a job is stranded so:

- Redis stops between the two: its reply to BRPOP is never sent, the message is gone.
- The message reached `unacked` just before the consumer lost its connection, but never reached a
  task: Celery drops what it had not started when the connection goes, and kombu's restore of the
  old channel's messages fails while Redis is down. A test of this project saw it: 199 of 200 jobs
  ran after a Redis restart, one was delivered 4 ms before the connection loss and never started.
- The whole worker is lost (killed, its spot machine gone) while its jobs run: their messages stay
  in `unacked` and their records say `running`; nothing rejects them.
- A job left `running` with no message anywhere: its message was acknowledged, or its requeue
  found nothing to restore, while its record still said `running` (a claim that failed after an
  engine loss once left 5 redelivered jobs so for 11 minutes; an engine lost while kombu had
  restored its channel's messages on a reconnect and this worker had dropped the second copy).

kombu would redeliver an `unacked` message after the visibility timeout (2 hours by default, and
it must exceed the hard time limit). This check does better: every `publish_every` seconds (the
heartbeat interval) each worker publishes the jobs its tasks hold, kept for the heartbeat TTL;
every `interval` seconds one of the model's workers (a lock in Redis) looks for queued jobs older
than `confirm` seconds whose message is in neither the queue's list nor `unacked`, for messages
in `unacked` held by no live worker whose job is queued or running, and for jobs claimed more
than `confirm` seconds ago (the model's running index, shared/keys.py) that are still running,
held by no live worker, with no message in the queue or `unacked`. A task holds its job from its
delivery until its engine answers, so a running job that no live worker holds is run by nobody,
whether the engine that claimed it lives or not (a paused worker's engine may: the job then runs
twice, and the fence of shared/attempts.py keeps one outcome). A job found so at two checks at least `confirm`
apart is sent again to the front of the queue (a stranded `unacked` entry is moved back, as
kombu's own restore does); its next claim counts one more attempt, so a job lost again and again
ends `worker_lost` after ACTQ_MAX_ATTEMPTS. A job whose record this version cannot read (a newer
version wrote it: shared/newer_records.py), or whose record is gone, is never sent again: a
worker could not run it, and sending it would loop.

A message is in flight between BRPOP and `unacked`, or between delivery and its task, for
microseconds; a live worker publishes what it holds within `publish_every` <= `confirm` seconds;
so a job that is running or about to run on a live worker is never sent twice. A job that did run
meanwhile has left the queued set or ended.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, cast

import redis
from pydantic import ValidationError

from shared import keys
from shared.newer_records import RecordCore
from shared.outages import REDIS, outage
from shared.states import TERMINAL_NAMES, JobStatus

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
    """Every message waiting in `queue`, in each of its lanes (shared/keys.py's `lanes`)."""
    for lane in keys.queue_lanes(queue):
        start = 0
        while chunk := client.lrange(lane, start, start + SCAN_CHUNK - 1):
            yield from chunk
            start += SCAN_CHUNK


def held_by_live_workers(client: redis.Redis, model: str) -> set[str]:
    held: set[str] = set()
    for key in client.scan_iter(match=keys.held(model, "*"), count=SCAN_CHUNK):
        held.update(_decode(m) for m in client.smembers(key))
    return held


def _record(client: redis.Redis, job_id: str) -> dict[str, Any] | None:
    raw = client.get(keys.job(job_id))
    try:
        record = None if raw is None else json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _in_state(record: dict[str, Any] | None, status: JobStatus) -> bool:
    """The record is in `status` and this version can change it (its core reads): one that cannot
    be read is never sent again, so no worker of this version takes it in a loop."""
    if record is None or record.get("status") != status.value:
        return False
    try:
        RecordCore.model_validate(record)
    except ValidationError:
        return False
    return True


def find_stranded(
    client: redis.Redis,
    model: str,
    queue: str,
    min_age: float,
    now: float | None = None,
) -> dict[str, str | None]:
    """Jobs of `model` whose message no live worker will run, each -> where its message is (None:
    lost; a delivery tag: stranded in `unacked`):

    - queued jobs older than `min_age` s whose message is in neither the queue nor `unacked`, or
      is in `unacked` held by no live worker;
    - running jobs whose message was delivered more than `min_age` s ago and sits in `unacked`
      held by no live worker: their whole worker was lost (killed, its machine gone, paused), or
      their task gave them up (their outcome could not be recorded through a Redis outage, and
      the requeue failed too);
    - running jobs claimed more than `min_age` s ago (the model's running index) whose message is
      nowhere (neither the queue nor `unacked`) and that no live worker holds (None: their message
      was acknowledged, or lost, while they still ran: a task whose outcome could not be recorded
      through a long Redis outage, or an engine lost after its requeue found nothing to restore).
      Whether their engine lives does not matter: a task holds its job until its engine answers,
      so a job no task holds is run by nobody.

    Only jobs whose records this version can change are named (their state, id, model, owner and
    creation time read). A queued job whose record is gone leaves the queued index, and a job of
    the running index that no longer runs leaves that index.

    Messages in `unacked` of jobs that already ended, held by nobody (their worker died between
    recording the outcome and acknowledging), are dropped on the way: their job is done."""
    now = time.time() if now is None else now
    waiting = cast("list[bytes]", client.zrangebyscore(keys.queued(model), "-inf", now - min_age))
    missing = {_decode(w) for w in waiting}
    claimed = cast("list[bytes]", client.zrangebyscore(keys.running(model), "-inf", now - min_age))
    idle = {_decode(c) for c in claimed} - missing  # running a while: is its message anywhere?
    if missing or idle:
        for raw in _messages(client, queue):
            seen = _task_id(raw) or ""
            missing.discard(seen)
            idle.discard(seen)
            if not missing and not idle:
                break
    missing = {j for j in missing if _queued_to_run(client, model, j)}
    stranded: dict[str, str | None] = dict.fromkeys(missing)
    held = held_by_live_workers(client, model)
    for tag, raw in client.hscan_iter(UNACKED, count=SCAN_CHUNK):
        job_id, tag = _task_id(raw), _decode(tag)
        if job_id is None or _queue_of(raw) != queue:
            continue
        idle.discard(job_id)  # its message is here: judged below, like any delivered message
        if job_id in missing:  # queued, and its message was delivered: stranded unless a worker holds it
            if job_id in held:
                del stranded[job_id]
            else:
                stranded[job_id] = tag
            continue
        if job_id in held:
            continue
        delivered = client.zscore(UNACKED_INDEX, tag)
        if delivered is None or now - delivered < min_age:
            continue  # just delivered: its task may not have published that it holds it yet
        record = _record(client, job_id)
        if record is None:
            continue
        status = record.get("status")
        if status in TERMINAL_NAMES:
            with client.pipeline(transaction=True) as pipe:  # nothing left to run: drop it
                pipe.hdel(UNACKED, tag)
                pipe.zrem(UNACKED_INDEX, tag)
                pipe.execute()
        elif status == "running":
            stranded[job_id] = tag
    for job_id in idle - held:  # running, with no message in the queue or `unacked`, held by no task
        record = _record(client, job_id)
        if not _in_state(record, JobStatus.running):  # ended, gone, or unreadable: not a running job of ours
            if record is None or record.get("status") != JobStatus.running.value:
                client.zrem(keys.running(model), job_id)
            continue
        stranded[job_id] = None
    # A job may have moved on while we looked (claimed, finished, cancelled): check again.
    return {j: tag for j, tag in stranded.items() if _still_stranded(client, model, j, tag)}


def _queued_to_run(client: redis.Redis, model: str, job_id: str) -> bool:
    """A job of the queued index that a worker of this version can take. One whose record is
    gone (expired while queued) leaves the index: nothing will ever run it."""
    record = _record(client, job_id)
    if record is None and not client.exists(keys.job(job_id)):
        client.zrem(keys.queued(model), job_id)
        return False
    return _in_state(record, JobStatus.queued)


def _queue_of(raw: bytes | str) -> str | None:
    try:
        entry = json.loads(raw)
        return str(entry[2]) if isinstance(entry, list) and len(entry) > 2 else None
    except (ValueError, TypeError):
        return None


def _still_stranded(client: redis.Redis, model: str, job_id: str, tag: str | None) -> bool:
    if client.zscore(keys.queued(model), job_id) is not None:
        return True
    if not _in_state(_record(client, job_id), JobStatus.running):
        return False
    return tag is not None or client.zscore(keys.running(model), job_id) is not None


class LostMessageSweeper:
    """Every `publish_every` s: publish what this worker holds (kept `held_ttl` s); every
    `interval` s (one of the model's workers a round, a lock in Redis): send again the message of
    each job found stranded at two checks at least `confirm` s apart.

    `clock` is the wall clock (Redis holds wall-clock times); tests pass their own."""

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
        publish_every: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publish_every = interval if publish_every is None else min(publish_every, interval)
        self.held_ttl = held_ttl if held_ttl is not None else 3 * self.publish_every
        if confirm < self.publish_every:
            raise ValueError("confirm must be at least publish_every: a worker publishes what it holds that often")
        self.client, self.model, self.queue, self.message = client, model, queue, message
        self.interval, self.confirm = interval, confirm
        self.worker_id, self.holding, self.clock = worker_id, holding, clock
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
        now = self.clock()
        stranded = find_stranded(self.client, self.model, self.queue, self.confirm, now)
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
            if stranded[job_id] is None and self.client.zscore(keys.running(self.model), job_id) is not None:
                log.warning(
                    "job %s was left running with no broker message and no task holding it (its message was "
                    "acknowledged or its requeue lost): sent it again",
                    job_id,
                )
            elif stranded[job_id] is None:
                log.warning("job %s was queued with no broker message (a Redis outage?): sent it again", job_id)
            else:
                log.warning(
                    "job %s: its message is stranded in unacked, held by no live worker (a Redis outage, or its "
                    "worker was lost): sent it again",
                    job_id,
                )
        return resent

    def run(self) -> None:
        next_sweep = time.monotonic() + self.interval
        while not self.stop.wait(self.publish_every):
            try:
                self.publish_held()
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.interval
                    self.sweep()
            except redis.RedisError as exc:  # an outage: the next round tries again
                outage(REDIS).failed(exc)
            else:
                outage(REDIS).ok()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="actq-lost-messages", daemon=True)
        thread.start()
        return thread

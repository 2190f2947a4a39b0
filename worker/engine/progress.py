"""Running jobs' progress, cancel flags and streamed text, kept off the engine thread.

The engine thread asks after every decoding step whether a job should stop (`Watch`); answering
from Redis there would put a network round trip (and, during an outage, seconds of retries) inside
the decoding loop of every job in the batch. Instead one thread of its own, every `interval`
seconds, reads all their cancel flags (`JobStore.cancels_asked`: one command while none is set),
and every `write_every` seconds writes every running job's progress with them in one pipelined
round trip (`JobStore.report_progress_many`); the engine thread reads what it last saw: a
dictionary lookup. A cancel is therefore seen within `interval` plus one step; GET /jobs/{id}'s
`generated_tokens` is at most `write_every` old. This thread shares the engine's process, and
so its GIL: on a CPU every command it packs and parses is time the decoding loop waits, hence
one command per round, not two per running job.

A streamed job (`stream: true`) also has its text published here: the same thread decodes what
its sequence generated since the last round (worker/engine/text_stream.py; the engine thread only
appends ids to a list this thread slices) and appends it to the job's Redis Stream
(`keys.job_text`), all streamed jobs in one more pipelined round trip; once the job has left the
engine an `end` entry follows. Each entry carries the offset of its text, so a reader can tell a
gap (entries trimmed, a round lost to an outage) from the next piece.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from shared import keys
from shared.jobs import JobStore
from shared.outages import REDIS, outage
from worker.batch.gate import Gate
from worker.engine.text_stream import TextStream

log = logging.getLogger(__name__)
TEXT_MAXLEN = 4096  # entries a job's text stream keeps (about: trimmed as Redis finds convenient)
TEXT_TTL_SECONDS = 3600  # a job's text stream expires this long after its last entry
WRITE_EVERY_S = 0.5  # seconds between writes of the running jobs' progress (cancel flags: every round)


@dataclass
class _Running:
    tokens: int = 0
    cancelled: bool = False
    text: TextStream | None = None  # a streamed job's text, decoded as it grows
    pending: str = ""  # its text not yet written to Redis
    at: int = 0  # the offset of `pending` in the text


class ProgressWatch:
    def __init__(
        self, jobs: JobStore, interval: float, gate: Gate | None = None, write_every: float = WRITE_EVERY_S
    ) -> None:
        """`gate`: the served model's (worker/batch/gate.py); streamed text is decoded through it."""
        self.jobs, self.interval, self.write_every = jobs, interval, write_every
        self._written_at = float("-inf")  # when the progress was last written
        self.gate = gate or Gate()
        self._running: dict[str, _Running] = {}
        self._ended: list[str] = []  # streamed jobs that left the engine: their `end` entry is next
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="actq-progress", daemon=True)

    def start(self) -> ProgressWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def add(self, job_id: str, text: TextStream | None = None) -> None:
        """A job joining the engine; `text` when its text is streamed."""
        with self._lock:
            self._running[job_id] = _Running(text=text)

    def remove(self, job_id: str) -> None:
        with self._lock:
            state = self._running.pop(job_id, None)
            if state is not None and state.text is not None:
                self._ended.append(job_id)

    def update(self, job_id: str, tokens: int | None) -> bool:
        """From the engine thread: the job's tokens so far (all checked for a stop string; None
        from a `baseline: true` job's unedited twin, whose count is not the job's); True when a
        cancel was seen."""
        state = self._running.get(job_id)
        if state is None:
            return False
        if tokens is not None:
            state.tokens = tokens
        return state.cancelled

    def poll(self) -> bool:
        """One round for every running job (the thread's loop; tests call it directly). True when
        it talked to Redis (it does not while no job runs)."""
        with self._lock:
            running = {job_id: state.tokens for job_id, state in self._running.items()}
            streamed = {job_id: state for job_id, state in self._running.items() if state.text is not None}
            ended, self._ended = self._ended, []
        try:
            if running:
                now = time.monotonic()
                if now - self._written_at >= self.write_every:
                    cancelled = self.jobs.report_progress_many(running)
                    self._written_at = now
                else:
                    cancelled = self.jobs.cancels_asked(list(running))
                with self._lock:
                    for job_id in cancelled:
                        if job_id in self._running:
                            self._running[job_id].cancelled = True
            if streamed or ended:
                self._publish(streamed, ended)
        except BaseException:
            with self._lock:  # their `end` entries go with the next round
                self._ended[:0] = ended
            raise
        return bool(running or streamed or ended)

    def _publish(self, streamed: dict[str, _Running], ended: list[str]) -> None:
        """Append each streamed job's new text to its Redis Stream, and `end` to those that left."""
        with self.gate.reading():  # decoding: never while trusted code runs on the model
            for job_id, state in streamed.items():
                assert state.text is not None
                try:
                    state.pending += state.text.advance(state.tokens)
                except Exception:  # a decode that fails is retried next round (the result has the text)
                    log.debug("job %s: decoding its new text failed", job_id, exc_info=True)
        writes = [(job_id, state) for job_id, state in streamed.items() if state.pending]
        if not writes and not ended:
            return
        with self.jobs.redis.pipeline(transaction=False) as pipe:
            for job_id, state in writes:
                key = keys.job_text(job_id)
                pipe.xadd(key, {"at": state.at, "t": state.pending}, maxlen=TEXT_MAXLEN, approximate=True)
                pipe.expire(key, TEXT_TTL_SECONDS)
            for job_id in ended:
                key = keys.job_text(job_id)
                pipe.xadd(key, {"end": 1}, maxlen=TEXT_MAXLEN, approximate=True)
                pipe.expire(key, TEXT_TTL_SECONDS)
            pipe.execute()
        for _, state in writes:
            state.at += len(state.pending)
            state.pending = ""

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            started = time.monotonic()
            try:
                if self.poll():
                    outage(REDIS).ok()
            except redis.RedisError as exc:  # progress is best effort; cancels are seen once Redis is back
                outage(REDIS).failed(exc)  # logged once per outage, not every round
            except Exception:  # this thread must outlive any one bad round
                log.exception("progress round failed")
            spent = time.monotonic() - started
            if spent > self.interval * 10:
                log.warning("a progress round took %.2f s", spent)

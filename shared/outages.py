"""Outages as a process's log tells them: one line when an outage of Redis or the artifact store
starts, one when it ends (with how long it lasted and how many calls failed meanwhile), whatever
the number of calls that fail in between.

Many loops reach Redis: a worker's engine writes progress and reads cancel flags every 50 ms,
beats every second and waits for tokenizer calls; its job store and the broker's acks retry
through an outage (stamina); the Celery worker reconnects; the API answers each request. Each
used to log every failure: during an outage the log filled with the same line, dozens a second.
Now each reports here (`failed`, `ok`); this module logs the first failure of an outage and the
first success after it, once per process.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

log = logging.getLogger("actq.outages")
REDIS = "Redis"
STORE = "the artifact store"


class Outage:
    """One dependency's state as this process saw it last: up, or down since a moment."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._since: float | None = None  # when the outage started (monotonic); None: up
        self._failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException | str) -> bool:
        """A call failed for want of the dependency. True when this starts an outage (then logged)."""
        with self._lock:
            self._failures += 1
            if self._since is not None:
                return False
            self._since, self._failures = time.monotonic(), 1
        log.warning("%s is unreachable (%s); waiting for it, this is said again when it is back", self.what, exc)
        return True

    def ok(self) -> None:
        """A call succeeded: an outage, if there was one, has ended (logged, with its duration)."""
        if self._since is None:  # the usual case: no lock taken
            return
        with self._lock:
            if self._since is None:
                return
            lasted, failures, self._since = time.monotonic() - self._since, self._failures, None
        log.warning("%s is back after %.1f s (%d calls failed meanwhile)", self.what, lasted, failures)


_outages: dict[str, Outage] = {}
_lock = threading.Lock()


def outage(what: str) -> Outage:
    """This process's one Outage for `what` (REDIS, STORE)."""
    with _lock:
        return _outages.setdefault(what, Outage(what))


def retry_hook(details: object) -> None:
    """A stamina on-retry hook: a retry through an outage counts as a failed call, silently (stamina's
    own hook logs a warning per retry)."""
    cause = getattr(details, "caused_by", None)
    if cause is not None:
        outage(REDIS if isinstance(cause, redis.RedisError) else STORE).failed(cause)


def quiet_retries() -> None:
    """Route stamina's retries (the job store's, the broker's acks, S3 uploads) to this module
    instead of a log line each. Called once by each worker process."""
    import stamina.instrumentation

    stamina.instrumentation.set_on_retry_hooks([retry_hook])


class ReconnectLines(logging.Filter):
    """On Celery's consumer logger: its lines about a lost or refused broker connection (one per
    reconnection attempt) become a failed call of the Redis outage, logged once."""

    LINES = ("consumer: Cannot connect to", "consumer: Connection to broker lost")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.LINES):
            return True
        cause = next((a for a in (record.args or ()) if isinstance(a, BaseException)), None)
        outage(REDIS).failed(cause or "the broker connection was lost")
        return False

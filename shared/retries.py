"""When the client (shared/client.py) sends a request again, and how long it keeps trying.

Retried, with exponential backoff and jitter (stamina, over tenacity): an answer of 429 (the
API's Retry-After is honoured) or 503 (the API did nothing: Redis or its store is away), and a
connection refused or timed out before the request was sent. A 502 or 504 (a proxy's answer)
and a connection lost after the request went out (a read error or timeout, a dropped
connection) may follow a request the API carried out, so they are retried only for requests
that can be sent twice without doing anything twice: GET, HEAD, PUT, DELETE and a POST the
caller marks so (a batch whose every job has an idempotency key, a tokenizer call). Every
other 4xx is the request's own fault and is never retried.

A connection refused before the API has answered once is never waited for: the URL is wrong,
or nothing runs there, and the user hears so at once. Once it has answered, a refused
connection is an outage (an API or object store restarting) and is retried like a 503.

The budget is a total deadline per request, `seconds` (60 by default; the CLI's
--retry-timeout; 0: no retries). A wait that would end past it is not begun: the last error is
raised, with a note saying how many tries it had and for how long (`exc.__notes__`). A wait is
cut short by `interrupted` (a bulk run's Ctrl-C flag): KeyboardInterrupt is raised between two
attempts, never inside an HTTP call.
"""

from __future__ import annotations

import email.utils
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import stamina

DEFAULT_SECONDS = 60.0
RETRY_STATUSES = frozenset({429, 502, 503, 504})
GATEWAY_STATUSES = frozenset({502, 504})  # said by a proxy, not the API: the request may have run
RESENDABLE_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)  # the request never left this machine


@dataclass(frozen=True)
class RetryPolicy:
    """`seconds`: how long one request may keep being retried (0: never); waits grow from
    `wait_initial` by doubling up to `wait_max`, each plus up to `jitter` seconds at random."""

    seconds: float = DEFAULT_SECONDS
    wait_initial: float = 0.5
    wait_max: float = 8.0
    jitter: float = 1.0

    def backoff(self, retry: int) -> float:
        """The wait before retry number `retry` (1-based), jitter included."""
        return min(self.wait_max, self.wait_initial * 2 ** (retry - 1)) + random.uniform(0, self.jitter)


def retry_after(response: httpx.Response) -> float | None:
    """A Retry-After header's seconds (a number, or an HTTP date), None without a usable one."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, moment.timestamp() - time.time())


def describe(exc: BaseException) -> str:
    """What went wrong, in a few words (for the line said before each retry)."""
    status = getattr(exc, "status_code", None)
    if status is not None:
        return f"{status} {getattr(exc, 'error_type', '')}: {' '.join(str(getattr(exc, 'detail', '')).split())[:300]}"
    url = exc.request.url if isinstance(exc, httpx.RequestError) and _has_request(exc) else None
    where = f" ({url.scheme}://{url.netloc.decode()})" if url is not None else ""
    return f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'no answer'}{where}"


def _has_request(exc: httpx.RequestError) -> bool:
    try:
        exc.request  # noqa: B018  # raises when the error was made without one
    except RuntimeError:
        return False
    return True


class Retrying:
    """The attempts of one request: `for attempt in Retrying(...): with attempt: ...`. Each error
    raised in an attempt is judged by `decide`; the wait before the next one is said to `notify`."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        resendable: bool,
        reached: Callable[[], bool] = lambda: True,
        notify: Callable[[str], None] | None = None,
        busy_retried: bool = True,
        interrupted: threading.Event | None = None,
    ) -> None:
        self.policy = policy
        self.resendable = resendable
        self.reached = reached
        self.notify = notify
        self.busy_retried = busy_retried
        self.interrupted = interrupted or threading.Event()
        self.started = time.monotonic()
        self.retries = 0

    def __iter__(self) -> Iterator[stamina.Attempt]:
        if self.policy.seconds <= 0:
            yield from stamina.retry_context(on=Exception, attempts=1, timeout=None)
            return
        # stamina's own bounds are a backstop: `decide` stops first, before a wait past the deadline
        yield from stamina.retry_context(on=self.decide, attempts=None, timeout=self.policy.seconds + 1)

    def retryable(self, exc: Exception) -> tuple[bool, float | None]:
        """Whether `exc` may be retried, and the wait the server asked for (Retry-After)."""
        status = getattr(exc, "status_code", None)
        if isinstance(status, int):
            if status == 429 and not self.busy_retried:
                return False, None
            if status in GATEWAY_STATUSES and not self.resendable:  # a proxy's: the API may have done it
                return False, None
            return status in RETRY_STATUSES, getattr(exc, "retry_after", None)
        if isinstance(exc, httpx.TransportError):
            if not self.reached():  # never answered: a wrong URL or nothing there, said at once
                return False, None
            return self.resendable or isinstance(exc, NOT_SENT), None
        return False, None

    def decide(self, exc: Exception) -> bool | float:
        """stamina's backoff hook: False to raise `exc` now; else it waits here (so that Ctrl-C
        ends the wait) and tells stamina to go on at once."""
        ok, asked = self.retryable(exc)
        if not ok:
            return False
        wait = asked if asked is not None else self.policy.backoff(self.retries + 1)
        elapsed = time.monotonic() - self.started
        if elapsed + wait > self.policy.seconds:
            tries = self.retries + 1
            why = f" (the server asked to wait {asked:.0f} s)" if asked is not None else ""
            exc.add_note(
                f"gave up after {tries} {'try' if tries == 1 else 'tries'} in {elapsed:.0f} s{why}: "
                f"the retry budget is {self.policy.seconds:g} s (--retry-timeout)"
            )
            return False
        self.retries += 1
        if self.notify is not None:
            self.notify(
                f"{describe(exc)}; retry {self.retries} in {wait:.1f} s "
                f"(retrying for up to {self.policy.seconds:g} s, --retry-timeout)"
            )
        if self.interrupted.wait(wait):
            raise KeyboardInterrupt
        return 0.0

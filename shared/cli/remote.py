"""The API as the bulk commands reach it (`actq run-file`, `gsm8k`, `probe`, `export`, `cancel`):
where it is (--api, else ACTQ_API_URL), the key sent (--api-key, else ACTQ_API_KEY), how long an
outage is waited out (--retry-timeout: each retry said on stderr), and what goes wrong on the way
said in one line (a ToolError: `error: ...` on stderr, exit 2) instead of a traceback, naming
exactly what failed: the API, or the object store a download was sent to, or the API's storage."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from shared.client import ActqClientError, Client
from shared.errors import ToolError
from shared.retries import DEFAULT_SECONDS
from shared.settings import Settings

WHERE = "point the command elsewhere with --api URL or ACTQ_API_URL"
KEY = "give the key with --api-key KEY or ACTQ_API_KEY"


def resolve(api: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The URL and key to use: the options', else the settings'."""
    if api is not None and api_key is not None:
        return api, api_key
    settings = Settings()
    return api or settings.api_url, api_key if api_key is not None else settings.api_key


def say_retry(line: str) -> None:
    """A retry, said on stderr above any progress bar."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type hints

    tqdm.write(f"actq: {line}", file=sys.stderr)


def client(api: str | None, api_key: str | None, timeout: float = 60, retry_seconds: float = DEFAULT_SECONDS) -> Client:
    url, key = resolve(api, api_key)
    quiet_stamina()
    return Client(url, api_key=key, timeout=timeout, retry_seconds=retry_seconds, on_retry=say_retry)


def quiet_stamina() -> None:
    """stamina logs each retry as a bare `stamina.retry_scheduled` warning, which Python prints
    on stderr when nothing is configured; say_retry says it in words instead."""
    stamina_log = logging.getLogger("stamina")
    if not any(isinstance(h, logging.NullHandler) for h in stamina_log.handlers):
        stamina_log.addHandler(logging.NullHandler())


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def _origin(url: str | httpx.URL) -> str:
    parsed = httpx.URL(str(url))
    return f"{parsed.scheme}://{parsed.netloc.decode()}"


def _failed_url(exc: httpx.HTTPError) -> httpx.URL | None:
    try:
        return exc.request.url
    except RuntimeError:  # an error made without its request
        return None


def _retried(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", None) or []
    return f" ({'; '.join(notes)})" if notes else ""


def explain(exc: BaseException, url: str) -> str | None:
    """One line for an error met talking to the API at `url`; None for anything else. It names
    what failed: the API, the object store the API redirected a download to, or (a 503
    `storage_error`) the API's own storage, in the API's words."""
    retried = _retried(exc)
    if isinstance(exc, httpx.TransportError):
        failed = _failed_url(exc)
        if failed is not None and _origin(failed) != _origin(url):  # a redirect: the object store
            return (
                f"cannot reach {_origin(failed)}, the object store the actq API at {url} sent the download to "
                f"({type(exc).__name__}: {one_line(exc) or 'no answer'}){retried}: its storage (S3) is down or not "
                "reachable from here; the API itself answered"
            )
    if isinstance(exc, httpx.TimeoutException):
        return f"the actq API at {url} did not answer in time ({type(exc).__name__}){retried}; is it up? {WHERE}"
    if isinstance(exc, httpx.TransportError):  # refused, unknown host, reset, ...
        return (
            f"cannot reach the actq API at {url} ({type(exc).__name__}: {one_line(exc) or 'no answer'}){retried}; "
            f"{WHERE}"
        )
    if isinstance(exc, ActqClientError):
        if exc.status_code in (401, 403):
            return f"the actq API at {url} refused the API key ({exc.status_code}: {one_line(exc.detail)}); {KEY}"
        if exc.error_type.startswith("http_"):  # not the API's error shape: something else answers there
            return f"{url} answered {exc.status_code} ({one_line(exc.detail)[:200]}): is it the actq API? {WHERE}"
        if exc.status_code == 503 and exc.error_type == "storage_error":
            return (
                f"the actq API at {url} answered that its storage is unavailable (503 storage_error: "
                f"{one_line(exc.detail)}){retried}"
            )
        return f"the actq API at {url} answered {one_line(str(exc))}{retried}"
    if isinstance(exc, httpx.HTTPError):
        return f"talking to the actq API at {url}: {type(exc).__name__}: {one_line(exc)}{retried}; {WHERE}"
    return None


@contextmanager
def reaching(api: str | None) -> Iterator[None]:
    """Errors met talking to the API (`api`, else ACTQ_API_URL) inside the block become a ToolError
    of one line naming the URL and how to change it."""
    try:
        yield
    except (httpx.HTTPError, ActqClientError) as exc:
        message = explain(exc, api or Settings().api_url)
        if message is None:  # pragma: no cover - explain covers both bases
            raise
        raise ToolError(message) from None

"""The API as the bulk commands reach it (`actq run-file`, `gsm8k`, `probe`, `export`): where it is
(--api, else ACTQ_API_URL), the key sent (--api-key, else ACTQ_API_KEY), and what goes wrong on
the way said in one line (a ToolError: `error: ...` on stderr, exit 2) instead of a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from shared.client import ActqClientError, Client
from shared.errors import ToolError
from shared.settings import Settings

WHERE = "point the command elsewhere with --api URL or ACTQ_API_URL"
KEY = "give the key with --api-key KEY or ACTQ_API_KEY"


def resolve(api: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The URL and key to use: the options', else the settings'."""
    if api is not None and api_key is not None:
        return api, api_key
    settings = Settings()
    return api or settings.api_url, api_key if api_key is not None else settings.api_key


def client(api: str | None, api_key: str | None, timeout: float = 60) -> Client:
    url, key = resolve(api, api_key)
    return Client(url, api_key=key, timeout=timeout)


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def explain(exc: BaseException, url: str) -> str | None:
    """One line for an error met talking to the API at `url`; None for anything else."""
    if isinstance(exc, httpx.TimeoutException):
        return f"the actq API at {url} did not answer in time ({type(exc).__name__}); is it up? {WHERE}"
    if isinstance(exc, httpx.TransportError):  # refused, unknown host, reset, ...
        return f"cannot reach the actq API at {url} ({type(exc).__name__}: {one_line(exc) or 'no answer'}); {WHERE}"
    if isinstance(exc, ActqClientError):
        if exc.status_code in (401, 403):
            return f"the actq API at {url} refused the API key ({exc.status_code}: {one_line(exc.detail)}); {KEY}"
        if exc.error_type.startswith("http_"):  # not the API's error shape: something else answers there
            return f"{url} answered {exc.status_code} ({one_line(exc.detail)[:200]}): is it the actq API? {WHERE}"
        return f"the actq API at {url} answered {one_line(str(exc))}"
    if isinstance(exc, httpx.HTTPError):
        return f"talking to the actq API at {url}: {type(exc).__name__}: {one_line(exc)}; {WHERE}"
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

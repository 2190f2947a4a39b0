"""The Python client for the actq API.

    from shared.client import Client

    with Client("http://localhost:8000") as actq:
        job = actq.submit("smollm2-135m", [{"role": "user", "content": "What is 2+3?"}],
                          max_tokens=32, capture={"modules": ["model.layers.{8,16}"]})
        job.wait(timeout=300)              # long polls GET /jobs/{id}?wait=...
        print(job.result.text)
        tensors = job.activations()        # {name: torch.Tensor}, sha256-checked
        layer8 = job.tensor("model.layers.8", rows=(0, 10))

Only httpx is needed to import this module; torch and safetensors are imported by the methods
that return tensors. Every API error becomes an `ActqClientError` subclass carrying the API's
`error` type and `detail` message. Outages are waited out: 429, 502, 503, 504 and lost
connections are retried with backoff for up to `retry_seconds` per request (shared/retries.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from shared.client_errors import (
    ActqClientError,
    BadRequest,
    Busy,
    ChecksumMismatch,
    Conflict,
    JobFailed,
    NotFound,
    Unavailable,
    raise_for_error,
)
from shared.client_jobs import TERMINAL, Job, Result, Usage
from shared.retries import DEFAULT_SECONDS, RESENDABLE_METHODS, Retrying, RetryPolicy

__all__ = [
    "ActqClientError",
    "BadRequest",
    "Busy",
    "NotFound",
    "Conflict",
    "Unavailable",
    "JobFailed",
    "ChecksumMismatch",
    "Client",
    "Job",
    "Result",
    "Usage",
    "TERMINAL",
]

MAX_LONG_POLL = 60.0  # the API's upper bound for ?wait=


class Client:
    """A connection to an actq API. `api_key`, when given, is sent as `Authorization: Bearer`.
    Use as a context manager, or call `close()`.

    `retry_seconds`: how long one request keeps being retried through an outage (429 with its
    Retry-After, 502/503/504, a lost connection; 0: never); `on_retry` is told each retry in a
    line (what failed, the wait). Other 4xx answers are raised at once (shared/retries.py)."""

    # defaults of what __init__ sets, for a client made without it (a test's in-process transport)
    retry = RetryPolicy()
    on_retry: Callable[[str], None] | None = None
    interrupted: threading.Event | None = None
    _answered = False

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 30.0,
        retry_seconds: float = DEFAULT_SECONDS,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.retry = RetryPolicy(seconds=retry_seconds)
        self.on_retry = on_retry
        self._answered = False  # the API has answered once: a refused connection is now an outage
        self.interrupted: threading.Event | None = None  # set: a retry's wait ends in KeyboardInterrupt
        # Redirects are followed only for downloads (the S3 store answers 307 to a presigned
        # URL); httpx drops the Authorization header when a redirect leaves the API's origin.
        # every answer, a redirect's included, is heard: the API (or its store) was reached
        hooks = {"response": [self._heard]}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout, event_hooks=hooks)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _heard(self, response: httpx.Response) -> None:
        self._answered = True

    @property
    def base_url(self) -> str:
        """The API's base URL, as given."""
        return str(self._http.base_url).rstrip("/")

    def _retrying(self, method: str, resendable: bool = False, busy_retried: bool = True) -> Retrying:
        """The attempts of one request (shared/retries.py): `resendable` marks a POST that may be
        sent twice; `busy_retried=False` raises a 429 at once (the caller has its own fallback)."""
        return Retrying(
            self.retry,
            resendable=resendable or method.upper() in RESENDABLE_METHODS,
            reached=lambda: self._answered,
            notify=self.on_retry,
            busy_retried=busy_retried,
            interrupted=self.interrupted,
        )

    def _request(
        self, method: str, path: str, *, resendable: bool = False, busy_retried: bool = True, **kwargs: Any
    ) -> httpx.Response:
        for attempt in self._retrying(method, resendable, busy_retried):
            with attempt:
                response = self._http.request(method, path, **kwargs)
                raise_for_error(response)
        return response

    @contextmanager
    def _stream(self, method: str, path: str, retried: bool = True, **kwargs: Any) -> Iterator[httpx.Response]:
        """A streamed answer (redirects followed: the S3 store answers 307 to a presigned URL); the
        request is retried until its headers arrive (unless `retried` is False: the caller retries
        the whole read), the body is the caller's to read."""
        request = self._http.build_request(method, path, **kwargs)
        attempts = self._retrying(method) if retried else Retrying(RetryPolicy(seconds=0), resendable=False)
        for attempt in attempts:
            with attempt:
                response = self._http.send(request, stream=True, follow_redirects=True)
                try:
                    raise_for_error(response)
                except BaseException:
                    response.close()
                    raise
        try:
            yield response
        finally:
            response.close()

    def _get_job(self, job_id: str, wait: float = 0.0) -> dict:
        if wait <= 0:
            return self._request("GET", f"/jobs/{quote(job_id, safe='')}").json()
        # The request is held up to `wait` seconds: the read timeout must outlast it.
        timeout = httpx.Timeout(self.timeout, read=wait + self.timeout)
        try:
            return self._request(
                "GET",
                f"/jobs/{quote(job_id, safe='')}",
                params={"wait": round(wait, 3)},
                timeout=timeout,
                busy_retried=False,
            ).json()
        except Busy:  # every long-poll place of the API is taken: a plain read (Job.wait then backs off)
            return self._request("GET", f"/jobs/{quote(job_id, safe='')}").json()

    def _await_final(self, job: Job, timeout: float | None, poll: float) -> None:
        """Long poll `GET /jobs/{id}?wait=` until `job` is final, its data updated in place (Job.wait
        says how); TimeoutError when it is not final after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = max(0.0, min(poll, MAX_LONG_POLL))
        pause = 0.0
        while not job.done:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"job {job.id} is still {job.status} after {timeout}s")
            hold = poll if remaining is None else min(poll, remaining)
            started = time.monotonic()
            job.data = self._get_job(job.id, wait=hold)
            if job.done:
                break
            if hold > 0 and time.monotonic() - started >= 0.9 * hold:
                pause = 0.0  # the long poll held as asked: no extra pause needed
            else:  # answered early without finishing: back off, never sleeping past the deadline
                pause = min(max(2 * pause, 0.05), 2.0)
                if deadline is not None:
                    pause = min(pause, max(0.0, deadline - time.monotonic()))
                time.sleep(pause)

    def submit(
        self,
        model: str,
        messages: list[dict] | None = None,
        *,
        prompt: str | None = None,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        capture: dict | None = None,
        idempotency_key: str | None = None,
        mode: str = "generate",
        logprobs: bool = False,
        top_logprobs: int | None = None,
        interventions: list[dict] | None = None,
        baseline: bool = False,
        metadata: dict[str, str] | None = None,
        user: str | None = None,
    ) -> Job:
        """Queue a completion (`POST /jobs`) of a chat (`messages`) or of raw text (`prompt`, for
        base models); returns the queued `Job`. `interventions` edits the model while it runs
        (docs/interventions.md), `baseline=True` also runs it unedited. `capture` is the capture spec, e.g.
        `{"modules": ["model.layers.*"], "positions": "all"}` or `{"preset": "residual", "layers": [8, 15]}`.
        `mode="trace"` generates nothing: one forward pass over the text (messages may end with
        the assistant turn to score). `logprobs`/`top_logprobs`: each token's log-probability.
        With `idempotency_key`, a retry returns the job the first request created. `metadata` (up to
        16 string pairs) and `user` are stored with the job, for `jobs()` to filter on."""
        if (messages is None) == (prompt is None):
            raise ValueError("give exactly one of messages (a chat) or prompt (raw text)")
        body: dict[str, Any] = {"model": model, "temperature": temperature, "top_p": top_p}
        if mode != "generate":
            body["mode"] = mode
        if logprobs:
            body["logprobs"] = True
        if top_logprobs is not None:
            body["top_logprobs"] = top_logprobs
        if baseline:
            body["baseline"] = True
        fields = (("messages", messages), ("prompt", prompt), ("max_tokens", max_tokens), ("seed", seed))
        tags = (("metadata", metadata), ("user", user))
        for key, value in (*fields, ("stop", stop), ("capture", capture), ("interventions", interventions), *tags):
            if value is not None:
                body[key] = value
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        answer = self._request("POST", "/jobs", json=body, headers=headers, resendable=idempotency_key is not None)
        return Job(self, answer.json())

    def submit_many(
        self,
        requests: Iterable[dict],
        idempotency_keys: Iterable[str] | None = None,
        batch_size: int = 1000,
        batch_bytes: int = 3 << 20,
    ) -> list[Job]:
        """Submit requests (dicts of `submit`'s arguments: model, messages, ...) through
        `POST /jobs/batch`, at most `batch_size` jobs and about `batch_bytes` of JSON a request
        (under the API's default body limit of 4 MiB); one bad request rejects its batch with the
        API's message naming its index. With `idempotency_keys` (one per request), re-running the
        same call after a failure part-way returns the jobs already created instead of duplicates."""
        requests = list(requests)
        keys: list[str | None] = [None] * len(requests) if idempotency_keys is None else list(idempotency_keys)
        if len(keys) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(keys)} idempotency keys")
        jobs: list[Job] = []
        entries: list[dict] = []
        size = 0
        for request, key in zip(requests, keys, strict=True):
            body = {k: v for k, v in request.items() if v is not None}
            if isinstance(body.get("stop"), str):
                body["stop"] = [body["stop"]]
            entry = {"request": body, "idempotency_key": key}
            entry_size = len(json.dumps(entry)) + 2
            if entries and (len(entries) >= batch_size or size + entry_size > batch_bytes):
                jobs += self._submit_batch(entries)
                entries, size = [], 0
            entries.append(entry)
            size += entry_size
        if entries:
            jobs += self._submit_batch(entries)
        return jobs

    def _submit_batch(self, entries: list[dict]) -> list[Job]:
        # sent again after a lost answer only when every job has a key: the API then returns the
        # jobs the first request made instead of making them twice
        resendable = all(entry["idempotency_key"] is not None for entry in entries)
        answer = self._request("POST", "/jobs/batch", json={"jobs": entries}, resendable=resendable).json()
        return [Job(self, {**item, "status": item["status"]}) for item in answer["jobs"]]

    def job(self, job_id: str) -> Job:
        """The job with this id (`GET /jobs/{id}`); `NotFound` when there is none."""
        return Job(self, self._get_job(job_id))

    def nnsight(self, model: Any, compress: bool = True, timeout: float | None = None) -> Any:
        """An nnsight backend that runs a trace of `model` (nnsight's TransformersModel) as an actq
        nnsight job over plain HTTP, with this client's key (one in ACTQ_NNSIGHT_KEYS): for networks
        where nnsight's own `remote=True` cannot open its WebSocket. Pass it as
        `model.trace(..., backend=client.nnsight(model))`; the trace's saves are set as a local run
        sets them, and are the backend's `.saves`. A failed job raises `JobFailed` with its
        traceback. Needs nnsight 0.8 installed (shared/nnsight_client.py)."""
        from shared.nnsight_client import backend

        return backend(self, model, compress, timeout)

    def jobs(
        self,
        *,
        status: str | None = None,
        metadata: dict[str, str] | None = None,
        user: str | None = None,
        created_after: str | None = None,
        limit: int | None = 50,
    ) -> list[dict]:
        """`GET /jobs`: the caller's jobs as summaries (`id`, `status`, `created_at`,
        `prompt_preview`, `metadata`, `user`...), newest first, that pass every filter given:
        `metadata` pairs, `user`, `status`, `created_after` (ISO 8601). At most `limit`;
        `limit=None`: all of them, read 1,000 a request along the API's cursor."""
        params: dict[str, str | int] = {f"metadata.{key}": value for key, value in (metadata or {}).items()}
        for name, value in (("status", status), ("user", user), ("created_after", created_after)):
            if value is not None:
                params[name] = value
        found: list[dict] = []
        cursor = None
        while limit is None or len(found) < limit:
            page: dict[str, str | int] = {"limit": 1000 if limit is None else min(1000, limit - len(found))}
            if cursor is not None:
                page["cursor"] = cursor
            response = self._request("GET", "/jobs", params={**params, **page})
            found += response.json()
            cursor = response.headers.get("x-actq-next-cursor")
            if cursor is None:
                break
        return found

    def models(self, include_offline: bool = False) -> list[dict]:
        """`GET /models`: served models, each with its module paths in forward order."""
        params = {"include_offline": "true"} if include_offline else None
        return self._request("GET", "/models", params=params).json()

    def tokenize(self, text: str, model: str | None = None, add_special_tokens: bool = True) -> list[int]:
        """`POST /tokenize`: the model's token ids for `text`, from a live worker's own tokenizer
        (`model`: default the only model served). `add_special_tokens` adds what the tokenizer
        adds around a text (a BOS for some models)."""
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": add_special_tokens}
        if model is not None:
            body["model"] = model
        return self._request("POST", "/tokenize", json=body, resendable=True).json()["tokens"]

    def tokenize_chat(
        self, messages: list[dict], model: str | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """`POST /tokenize` of a chat: the ids a chat job with these messages is given (rendered
        with the model's chat template; `add_generation_prompt` opens the assistant's turn)."""
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if model is not None:
            body["model"] = model
        return self._request("POST", "/tokenize", json=body, resendable=True).json()["tokens"]

    def detokenize(self, ids: list[int], model: str | None = None) -> str:
        """`POST /detokenize`: the text of token ids, special tokens included; `BadRequest` naming
        the first id outside the model's vocabulary."""
        body: dict[str, Any] = {"tokens": list(ids)}
        if model is not None:
            body["model"] = model
        return self._request("POST", "/detokenize", json=body, resendable=True).json()["prompt"]

    def upload_vectors(self, data: bytes, label: str | None = None) -> dict:
        """`POST /vectors`: a safetensors file's bytes (one `[W]` or `[n, W]` float tensor per
        vector); returns the vector set's record (`id`, `tensors`, `sha256`...). Name its
        tensors in interventions as `{"vector_id": record["id"], "name": ...}`."""
        params = {"label": label} if label is not None else None
        headers = {"content-type": "application/octet-stream"}
        return self._request("POST", "/vectors", content=data, params=params, headers=headers).json()

    def vector_sets(self, limit: int = 100) -> list[dict]:
        """`GET /vectors`: the caller's vector sets, newest first."""
        return self._request("GET", "/vectors", params={"limit": limit}).json()

    def vector_set(self, vector_id: str) -> dict:
        """`GET /vectors/{id}`: one vector set's record (`tensors`: name -> shape and dtype)."""
        return self._request("GET", f"/vectors/{quote(vector_id, safe='')}").json()

    def delete_vectors(self, vector_id: str) -> None:
        """`DELETE /vectors/{id}`: the set's file and record."""
        self._request("DELETE", f"/vectors/{quote(vector_id, safe='')}")

    def health(self) -> dict:
        """`GET /health`: `{"status": "ok", "redis": "ok", "workers": {model: count}}`;
        `Unavailable` when the API cannot reach Redis."""
        return self._request("GET", "/health").json()

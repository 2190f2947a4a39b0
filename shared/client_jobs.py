"""A job as the Python client sees it (`Job`): its state as the API last described it, its result
(fetched whole when the API keeps it apart), waiting for its end, cancel and delete; its files
come from shared/client_downloads.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from shared.client_downloads import JobDownloads
from shared.client_errors import JobFailed
from shared.states import TERMINAL_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from shared.client import Client

TERMINAL = TERMINAL_NAMES  # job states that are final


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Result:
    """A finished job's completion: `text`, `finish_reason` (`stop` or `length`), `usage`;
    `logprobs` (the result's JSON: `content`, `total`, `completion_total`) when asked for, and a
    trace's `completion_span` (the final assistant turn's token range)."""

    text: str
    finish_reason: str
    usage: Usage
    logprobs: dict | None = None
    completion_span: tuple[int, int] | None = None
    interventions: list[dict] | None = None  # per edit and module: `applied` per step, `total`
    baseline: dict | None = None  # `baseline: true`: the unedited run's text, finish_reason, usage

    @classmethod
    def from_dict(cls, data: dict) -> Result:
        span = data.get("completion_span")
        return cls(
            text=data["text"],
            finish_reason=data["finish_reason"],
            usage=Usage(**data["usage"]),
            logprobs=data.get("logprobs"),
            completion_span=(span[0], span[1]) if span else None,
            interventions=data.get("interventions"),
            baseline=data.get("baseline"),
        )


class Job(JobDownloads):
    """One job as the API last described it. `data` is the raw job JSON; `refresh()` and
    `wait()` update it in place."""

    def __init__(self, client: Client, data: dict) -> None:
        self._client = client
        self.data = data

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, status={self.status!r})"

    @property
    def id(self) -> str:
        return self.data["id"]

    @property
    def status(self) -> str:
        """`queued`, `running`, `succeeded`, `failed` or `cancelled` (as of the last answer)."""
        return self.data["status"]

    @property
    def done(self) -> bool:
        """True once the job is in a final state."""
        return self.status in TERMINAL

    @property
    def result(self) -> Result | None:
        """The completion once the job has succeeded, else None. A large result (long text, many
        log-probabilities) is kept apart from the job by the API: it is fetched whole here
        (`GET /jobs/{id}/result`, once), so `text` and `logprobs` are always complete."""
        raw = self.data.get("result")
        if raw is None:
            return None
        if raw.get("stored") is not None:
            raw = self.result_data()
        return Result.from_dict(raw)

    @property
    def logprobs(self) -> dict | None:
        """The result's `logprobs` (`content`: one entry per token, `total`, `completion_total`),
        fetched whole when the API keeps them apart; None when not asked for or not finished."""
        result = self.result
        return None if result is None else result.logprobs

    def result_data(self) -> dict:
        """The whole result's JSON (`GET /jobs/{id}/result`), fetched once per finished job."""
        cached = getattr(self, "_whole", None)
        if cached is None or cached[0] is not self.data:
            whole = self._client._request("GET", f"/jobs/{quote(self.id, safe='')}/result").json()
            self._whole = (self.data, whole)
            return whole
        return cached[1]

    def request(self) -> dict:
        """The request the job was made from, as stored (`GET /jobs/{id}/request`): its whole
        prompt or messages, capture, metadata and user."""
        return self._client._request("GET", f"/jobs/{quote(self.id, safe='')}/request").json()

    @property
    def manifest(self) -> dict | None:
        """The activations manifest (uri, key, sha256, bytes, tensors[...]) once the job has
        succeeded with a capture spec, else None."""
        return self.data.get("activations")

    @property
    def error(self) -> dict | None:
        """`{type, message}` for a failed job, else None."""
        return self.data.get("error")

    def refresh(self, wait: float = 0.0) -> Job:
        """Re-read the job (`GET /jobs/{id}`); with `wait`, long-poll up to that many seconds
        (at most 60) for it to finish. Returns self; never raises for a failed job."""
        self.data = self._client._get_job(self.id, wait=min(wait, 60.0))
        return self

    def wait(self, timeout: float | None = None, poll: float = 30.0) -> Job:
        """Block until the job is final, long polling `GET /jobs/{id}?wait=` (each request held
        up to `poll` seconds, at most 60). Returns self once it has succeeded.

        Raises `JobFailed` when it failed or was cancelled, `TimeoutError` when it is not final
        after `timeout` seconds (None: wait forever). Should the server answer a long poll early
        without the job being final, the next requests are spaced with a growing pause."""
        self._client._await_final(self, timeout, poll)
        if self.status != "succeeded":
            error = self.error or {"type": self.status, "message": f"job {self.id} was {self.status}"}
            raise JobFailed(self, error["type"], error["message"])
        return self

    # --- cancel / delete ---------------------------------------------------------------------

    def cancel(self) -> Job:
        """`POST /jobs/{id}/cancel`: a queued job becomes `cancelled`; a running one is stopped
        within a decoding step (this Job then still says `running`: `wait()` for its end). Never
        deletes anything: `Conflict` when the job had already finished. Returns self."""
        self.data = self._client._request("POST", f"/jobs/{quote(self.id, safe='')}/cancel", resendable=True).json()
        return self

    def delete(self) -> Job:
        """`DELETE /jobs/{id}`: a queued job becomes `cancelled` (this Job is updated); a finished
        job's record and artifacts are deleted (this Job keeps its last known state). Returns self."""
        response = self._client._request("DELETE", f"/jobs/{self.id}")
        if response.status_code == 200 and response.content:
            self.data = response.json()
        return self

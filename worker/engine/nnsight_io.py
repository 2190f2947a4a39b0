"""An nnsight job's way in and out of the engine (the run itself: worker/nnsight/jobs.py): its
payload read from storage, checked against the hash the API recorded and, when compressed,
decompressed under the API's cap (never at the size its frame declares), its printed lines
published to Redis as they come (the API sends them as LOG statuses), and its saves stored
where activations go (the folder of the attempt that ran it; the record's `result.nnsight.key`),
under the result size cap."""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from shared import keys, nnsight_payload
from shared.attempts import Attempt
from shared.errors import ActqError, PayloadMismatch, ResultTooLarge
from shared.schemas import JobRecord, JobResult, NnsightOutput, Usage
from shared.storage import nnsight_request_key, nnsight_result_key
from worker.engine.core import Alone

if TYPE_CHECKING:
    from shared.settings import Settings
    from worker.engine import runtime
    from worker.nnsight.jobs import Outcome

log = logging.getLogger(__name__)


def job(rt: runtime.Runtime, record: JobRecord, done: Callable[[Any], None], started: Callable[[], None]) -> Alone:
    """The engine's exclusive run of `record` (read here, on the preparing thread)."""
    from worker.nnsight import jobs as nnsight_jobs

    call = record.request.nnsight
    assert call is not None
    blob = b"".join(rt.store.stream(nnsight_request_key(record.id)))
    if len(blob) != call.bytes or hashlib.sha256(blob).hexdigest() != call.sha256:
        raise PayloadMismatch(
            f"the stored payload ({len(blob)} bytes) is not the one the API recorded ({call.bytes} bytes, sha256 "
            f"{call.sha256[:12]}...); send the request again"
        )
    if call.compress:  # under the API's cap, whatever the frame declares (shared/nnsight_payload.py)
        try:
            blob = nnsight_payload.decompress(blob, rt.settings.nnsight_max_request_bytes)
        except ActqError as exc:
            raise PayloadMismatch(f"the stored payload is not one the API accepts: {exc.message}") from None
    limit = limits(rt.settings, record)[0]
    emit = _logs.emitter(rt, record.id)
    emit(served_note(rt))  # the job's first LOG line: what runs here instead of the client's own settings
    return Alone(
        run=lambda: nnsight_jobs.run(rt.served, blob, False, limit, emit),
        done=done,
        started=started,
        job_id=record.id,
        owner=record.owner,
    )


def limits(settings: Settings, record: JobRecord) -> tuple[float, float]:
    """(soft, hard) seconds for an nnsight job: at the soft limit its code is interrupted; code
    that will not stop is ended with its engine at the hard one, half as long again (at least 10 s
    more), never past ACTQ_JOB_TIME_LIMIT: one trusted job holds the model from everyone else's
    jobs for no longer."""
    soft = min(settings.nnsight_limit, record.request.time_limit or float("inf"))
    return soft, min(settings.job_time_limit, soft + max(10.0, soft / 2))


def record(rt: runtime.Runtime, record: JobRecord, outcome: Outcome, attempt: Attempt) -> int:
    """Store the saves in `attempt`'s folder and mark the job succeeded, if it is still that
    attempt's (else StaleAttempt: the caller removes the folder); returns the bytes stored."""
    from worker.nnsight.jobs import save_result

    call = record.request.nnsight
    assert call is not None
    data = save_result(outcome.saves, call.compress)
    cap = rt.settings.nnsight_max_result_bytes
    if len(data) > cap:
        raise ResultTooLarge(
            f"the nnsight job saved {len(data):,} bytes, over this deployment's cap of {cap:,} "
            "(ACTQ_NNSIGHT_MAX_RESULT_BYTES): save less (a slice, a mean, a lower dtype)"
        )
    key = nnsight_result_key(attempt.prefix(record.id))
    rt.store.put_bytes(key, data)
    output = NnsightOutput(
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        saved=sorted(outcome.saves),
        key=key,
        restored=outcome.restored,
        held_s=round(outcome.held_s, 6),
        served=served_settings(rt),
    )
    result = JobResult(text="", finish_reason="stop", usage=Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0))
    result.nnsight = output
    rt.jobs.succeed(record.id, result.model_dump(), None, rt.settings.result_inline_bytes, attempt=attempt)
    return len(data)


# nnsight's TransformersModel sets its tokenizer to pad a causal model's batch on the left
# (`_configure_tokenizer`), on the worker's tokenizer as on the client's; actq serves causal models.
PADDING_SIDE = "left"
RANDOM_STATE = "the worker's: seed inside the trace (torch.manual_seed) to sample reproducibly"


def served_settings(rt: runtime.Runtime) -> dict[str, str]:
    """What a run on this engine uses where the client's own settings stay on its machine or do
    not apply (one model serves every nnsight job): result.nnsight.served (docs/nnsight.md)."""
    info = rt.served.info
    return {
        "dtype": info.dtype,
        "attn_implementation": info.attention or "default",
        "padding_side": PADDING_SIDE,
        "random_state": RANDOM_STATE,
    }


def served_note(rt: runtime.Runtime) -> str:
    """`served_settings` as the client reads it in its terminal, with what to do to match a local run."""
    used = served_settings(rt)
    return (
        f"actq: runs on {rt.served.info.name} as served: dtype {used['dtype']}, attention "
        f"{used['attn_implementation']}, padding on the {used['padding_side']}. Your client's dtype, tokenizer "
        f"settings (padding side) and random state do not apply here: build your model with dtype={used['dtype']} "
        f"to match, pad on the {used['padding_side']}, and seed inside the trace (torch.manual_seed) for sampling "
        '(docs/nnsight.md, "What travels")'
    )


class _Logs:
    """One thread per process that writes printed lines to Redis (the engine thread never waits
    on Redis): appended to the job's list, then announced on its event channel."""

    def __init__(self) -> None:
        self._lines: queue.SimpleQueue[tuple[redis.Redis, int, str, str]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._written = threading.Condition()
        self._pending: dict[str, int] = {}  # job id -> lines not yet written

    def flush(self, job_id: str, timeout: float = 10.0) -> None:
        """Until the job's printed lines are in Redis (before its outcome: the LOG statuses of a
        job come before its last status)."""
        with self._written:
            self._written.wait_for(lambda: not self._pending.get(job_id), timeout)

    def emitter(self, rt: runtime.Runtime, job_id: str) -> Callable[[str], None]:
        client, ttl = rt.jobs.redis, rt.settings.job_retention_seconds

        def emit(line: str) -> None:
            with self._written:
                self._pending[job_id] = self._pending.get(job_id, 0) + 1
            self._lines.put((client, ttl, job_id, line))
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="actq-nnsight-logs", daemon=True)
                    self._thread.start()

        return emit

    def _loop(self) -> None:
        while True:
            client, ttl, job_id, line = self._lines.get()
            try:
                with client.pipeline(transaction=False) as pipe:
                    pipe.rpush(keys.nnsight_log(job_id), line)
                    pipe.expire(keys.nnsight_log(job_id), ttl)
                    pipe.publish(keys.job_events(job_id), "log")
                    pipe.execute()
            except redis.RedisError:
                log.warning("job %s: a printed line could not be published (Redis is unreachable)", job_id)
            finally:
                with self._written:
                    left = self._pending.get(job_id, 1) - 1
                    if left:
                        self._pending[job_id] = left
                    else:
                        self._pending.pop(job_id, None)
                    self._written.notify_all()


_logs = _Logs()
flush_logs = _logs.flush

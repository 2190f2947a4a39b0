"""Every Redis key and Celery name actq uses, in one place."""

from __future__ import annotations

import hashlib

PREFIX = "actq"
TASK_NAME = "actq.run_job"
MODELS = f"{PREFIX}:models"  # set of model names ever served


def job(job_id: str) -> str:
    """The JSON JobRecord of one job."""
    return f"{PREFIX}:job:{job_id}"


def result(job_id: str) -> str:
    """A large result's whole JSON, stored apart from the record (same TTL): GET /jobs/{id}/result."""
    return f"{PREFIX}:result:{job_id}"


def job_events(job_id: str) -> str:
    """Pub/sub channel announcing a job's state changes (for GET /jobs/{id}?wait=)."""
    return f"{PREFIX}:job-events:{job_id}"


def cancel(job_id: str) -> str:
    """Set by DELETE on a running job; the worker's stopping criterion reads it every step."""
    return f"{PREFIX}:cancel:{job_id}"


def progress(job_id: str) -> str:
    """Tokens a running job has generated so far (written by the worker while it generates)."""
    return f"{PREFIX}:progress:{job_id}"


def job_text(job_id: str) -> str:
    """Redis Stream of a streamed job's text as the worker generates it (`stream: true`): entries
    {at: offset, t: text} appended by the worker's progress thread, then {end: 1} once the job left
    the engine; read by the API's server-sent events (bounded length, expires after the job)."""
    return f"{PREFIX}:job-text:{job_id}"


def nnsight_log(job_id: str) -> str:
    """List of what an nnsight job printed, line by line (LOG statuses), appended by the worker
    while it runs; expires with the job's retention."""
    return f"{PREFIX}:nnsight-log:{job_id}"


def nnsight_session(owner: str | None, session_id: str) -> str:
    """List of the jobs one API key sent with one nnsight WebSocket session (its statuses go to that
    socket); `job_events(nnsight_session(...))` announces a new one. Keyed by the owner too: another
    key that learns the session id sends into a list of its own, never into this socket."""
    return f"{PREFIX}:nnsight-session:{owner or '_'}:{session_id}"


def nnsight_link(token: str) -> str:
    """An nnsight result's download link (its client sends no key there): token -> job id, expiring."""
    return f"{PREFIX}:nnsight-link:{token}"


def nnsight_job_link(job_id: str) -> str:
    """The one download link token given out for an nnsight job's result (expiring with the link)."""
    return f"{PREFIX}:nnsight-job-link:{job_id}"


def queued(name: str) -> str:
    """Sorted set of a model's queued job ids by enqueue time: a queued job's position."""
    return f"{PREFIX}:queued:{name}"


def running(name: str) -> str:
    """Sorted set of a model's running job ids by when they were claimed: the lost-message check
    looks here for a job left running with no broker message (worker/lost_messages.py)."""
    return f"{PREFIX}:running:{name}"


def jobs_index(owner: str | None) -> str:
    """Sorted set of one API key's jobs (all jobs when keys are off), by creation time: GET /jobs."""
    return f"{PREFIX}:jobs-index:{owner or '_'}"


def jobs_status_index(owner: str | None, status: str) -> str:
    """The same for the jobs in one state, kept with every state change: GET /jobs?status=."""
    return f"{PREFIX}:jobs-index:{owner or '_'}:{status}"


def jobs_tag_index(owner: str | None, field: str, value: str) -> str:
    """The same for the jobs with one request tag: `field` "metadata.<key>" (one `metadata` pair)
    or "user", equal to `value` (hashed: it is user text): GET /jobs?metadata.<key>=<value>.
    Written with the job; it expires a retention after its newest job, as their records do."""
    digest = hashlib.sha256(f"{field}\0{value}".encode()).hexdigest()[:32]
    return f"{PREFIX}:jobs-index:{owner or '_'}:tag:{digest}"


def counters(name: str) -> str:
    """Hash of a model's job counters (submitted, succeeded, ..., generated_tokens)."""
    return f"{PREFIX}:stats:{name}:counters"


def histogram(name: str, which: str) -> str:
    """Hash of one of a model's histograms (each bucket's own count, sum, count: shared/stats.py).
    Named apart from the cumulative hashes earlier versions wrote, which a reader would misread."""
    return f"{PREFIX}:stats:{name}:{which}:by-bucket"


def throughput(name: str) -> str:
    """Hash of a model's workers' tokens per second over their last heartbeat interval."""
    return f"{PREFIX}:stats:{name}:throughput"


def kv_cache(name: str) -> str:
    """Hash of a model's workers' KV cache now: "bytes slots positions" per worker (its last heartbeat)."""
    return f"{PREFIX}:stats:{name}:kv-cache"


def idempotency(key: str) -> str:
    """Maps a client's Idempotency-Key (hashed: it is user text) to a job id."""
    return f"{PREFIX}:idem:{hashlib.sha256(key.encode()).hexdigest()}"


def model(name: str) -> str:
    """The published description of a served model (module list, sizes)."""
    return f"{PREFIX}:model:{name}"


def workers(name: str) -> str:
    """Sorted set of worker ids serving a model, scored by last heartbeat (unix seconds)."""
    return f"{PREFIX}:workers:{name}"


def lost_sweep(name: str) -> str:
    """Lock: the one worker checking a model's queue for lost broker messages this round."""
    return f"{PREFIX}:lost-sweep:{name}"


def lost_suspects(name: str) -> str:
    """Hash of a model's queued jobs seen without a broker message: job id -> first seen (unix s)."""
    return f"{PREFIX}:lost-suspects:{name}"


def held(name: str, worker_id: str) -> str:
    """Set of the job ids a worker's tasks hold (expires unless the worker renews it)."""
    return f"{PREFIX}:held:{name}:{worker_id}"


def queue(name: str) -> str:
    """The Celery queue that a model's workers consume: the Redis list of its first lane (see
    `lanes`)."""
    return f"{PREFIX}.{name}"


# kombu's Redis transport keeps a queue's messages of priority p in the list `<queue>` (p = 0) or
# `<queue>\x06\x16<p>`, for p in its priority steps, and pops them in that order (BRPOP over the
# lists, first non-empty first). shared/broker.py pins both sides to these steps.
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEP = "\x06\x16"


def lanes(name: str) -> list[str]:
    """The Redis lists of a model's queue, the one served first first: a job goes to a later lane
    the more jobs its key already holds (shared/jobs.py's `_ENQUEUE`), so one key's burst never
    makes another key's job wait behind it."""
    return queue_lanes(queue(name))


def queue_lanes(queue_name: str) -> list[str]:
    """`lanes` of the queue named `queue_name`."""
    return [queue_name if step == 0 else f"{queue_name}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def quota(owner: str | None) -> str:
    """Hash of what one API key (`_`: callers without keys) has queued or running: `jobs` and
    `bytes` (their estimated capture bytes), checked against ACTQ_MAX_QUEUED_*_PER_KEY."""
    return f"{PREFIX}:quota:{owner or '_'}"


def quota_held(owner: str | None) -> str:
    """Hash of those jobs' ids -> estimated capture bytes: each is released exactly once."""
    return f"{PREFIX}:quota:{owner or '_'}:held"


def vector_set(vector_id: str) -> str:
    """The JSON VectorSet record of one uploaded vector set (no TTL: kept until deleted)."""
    return f"{PREFIX}:vector-set:{vector_id}"


def vector_sets_index(owner: str | None) -> str:
    """Sorted set of one API key's vector sets (`_`: callers without keys), by creation time:
    GET /vectors, and the count checked against ACTQ_MAX_VECTOR_SETS_PER_KEY."""
    return f"{PREFIX}:vector-sets:{owner or '_'}"


def tokenizer_requests(name: str) -> str:
    """List of a model's pending tokenizer calls (POST /tokenize, /detokenize, GET /tokenizer_info),
    JSON, taken by whichever of its live workers pops one first."""
    return f"{PREFIX}:tokenizer:{name}"


def tokenizer_reply(call_id: str) -> str:
    """A worker's JSON reply to one tokenizer call; expires soon, so an abandoned reply disappears."""
    return f"{PREFIX}:tokenizer-reply:{call_id}"

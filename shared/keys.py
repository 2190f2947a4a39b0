"""Every Redis key and Celery name actq uses, in one place."""

from __future__ import annotations

import hashlib

PREFIX = "actq"
TASK_NAME = "actq.run_job"
MODELS = f"{PREFIX}:models"  # set of model names ever served


def job(job_id: str) -> str:
    """The JSON JobRecord of one job."""
    return f"{PREFIX}:job:{job_id}"


def job_events(job_id: str) -> str:
    """Pub/sub channel announcing a job's state changes (for GET /jobs/{id}?wait=)."""
    return f"{PREFIX}:job-events:{job_id}"


def idempotency(key: str) -> str:
    """Maps a client's Idempotency-Key (hashed: it is user text) to a job id."""
    return f"{PREFIX}:idem:{hashlib.sha256(key.encode()).hexdigest()}"


def model(name: str) -> str:
    """The published description of a served model (module list, sizes)."""
    return f"{PREFIX}:model:{name}"


def workers(name: str) -> str:
    """Sorted set of worker ids serving a model, scored by last heartbeat (unix seconds)."""
    return f"{PREFIX}:workers:{name}"


def queue(name: str) -> str:
    """The Celery queue (a Redis list) that a model's workers consume."""
    return f"{PREFIX}.{name}"

"""What a job's attempts leave in storage (shared/attempts.py): each writes in a folder of its
own, and only the folder the record names stays. An attempt that lost removes its own folder; an
attempt after the first that recorded the outcome removes the folders of earlier ones (an engine
or worker that died between its upload and its record left them). Both best effort, logged: a
folder left behind is never read (readers follow the record) and DELETE /jobs/{id} removes it."""

from __future__ import annotations

import logging

from celery.utils.log import get_task_logger

from shared.attempts import Attempt, StaleAttempt
from shared.errors import StorageError
from shared.storage import ArtifactStore, job_prefix

log = get_task_logger(__name__)
log.setLevel(logging.INFO)  # as worker/engine/job_flow.py: one line per job at Celery's default level


def discard(store: ArtifactStore, job_id: str, lost: StaleAttempt) -> None:
    """The job was claimed again (its worker looked lost: paused, or cut off from Redis, past the
    heartbeat TTL) or ended otherwise: log that this attempt's outcome is not recorded and remove
    what it wrote. Only its own folder: every other attempt writes in another."""
    prefix = lost.attempt.prefix(job_id)
    log.warning("%s; its outcome is not recorded and its folder %s is removed", lost, prefix)
    if lost.attempt.published(job_id, lost.record):  # never: a refused outcome names no files
        return
    try:
        store.delete_prefix(prefix)
    except (StorageError, OSError) as exc:
        log.warning("job %s: the files of its %s are left at %s: %s", job_id, lost.attempt, prefix, exc)


def tidy(store: ArtifactStore, job_id: str, attempt: Attempt, succeeded: bool) -> None:
    """`attempt` has just recorded the job's outcome: if it is not the first, remove every attempt
    folder the record does not name (all but its own when it succeeded, all when it failed)."""
    if attempt.number <= 1:  # no earlier attempt (a first attempt that failed removed its own files)
        return
    keep = attempt.prefix(job_id) if succeeded else None
    try:
        for folder in store.folders(job_prefix(job_id)):
            if folder != keep and folder.rsplit("/", 1)[-1].startswith("attempt-"):
                store.delete_prefix(folder)
                log.info("job %s: removed %s, left by an attempt whose outcome was not recorded", job_id, folder)
    except (StorageError, OSError) as exc:
        log.warning("job %s: the folders of its earlier attempts were not removed: %s", job_id, exc)


def withdraw(store: ArtifactStore, job_id: str, attempt: Attempt) -> None:
    """This attempt wrote its files, then its job ended otherwise (a cancel that won over its
    success): remove its own folder, which no record names."""
    prefix = attempt.prefix(job_id)
    try:
        store.delete_prefix(prefix)
    except (StorageError, OSError) as exc:
        log.warning("job %s: the files of its %s are left at %s: %s", job_id, attempt, prefix, exc)

"""Idempotency keys: a client's key maps to the job its first request created.

A key is claimed (SET NX) before the job is recorded; the job's record and message follow in the
next transaction. A second request with the key gets the recorded job back. Keys are per API key
(`scoped`), so two callers never share a job through a key, and are stored hashed (user text).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import cast

import redis

from shared import keys
from shared.errors import NotReady
from shared.jobs import JobStore
from shared.schemas import JobRecord

RECORDING_WAIT = 2.0  # seconds a retry waits for the first request to record its job


def scoped(key: str, owner: str | None) -> str:
    """Idempotency keys are per API key: two callers never share a job through a key."""
    return key if owner is None else f"{owner}:{key}"


class IdempotencyKeys:
    def __init__(self, client: redis.Redis, jobs: JobStore, retention_seconds: int) -> None:
        self.redis = client
        self.jobs = jobs
        self.retention = retention_seconds

    def claim(self, key: str, job_id: str) -> JobRecord | None:
        """None when `job_id` now owns the key; else the job an earlier request with the key created."""
        idem = keys.idempotency(key)
        if self.redis.set(idem, job_id, nx=True, ex=self.retention):
            return None
        return self._existing(key, idem, job_id)

    def claim_many(self, wanted: Sequence[tuple[str, str]]) -> list[JobRecord | None]:
        """Claim many (key, job id) pairs in one round trip; for each, None when claimed, else the
        job an earlier request created. Raises (after releasing what it claimed) if one waits too long."""
        if not wanted:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for key, job_id in wanted:
                pipe.set(keys.idempotency(key), job_id, nx=True, ex=self.retention)
            claimed = pipe.execute()
        found: list[JobRecord | None] = [None] * len(wanted)
        try:
            for i, ((key, job_id), ok) in enumerate(zip(wanted, claimed, strict=True)):
                if not ok:
                    found[i] = self._existing(key, keys.idempotency(key), job_id)
        except Exception:
            self.release([key for (key, _), ok in zip(wanted, claimed, strict=True) if ok])
            raise
        return found

    def release(self, claimed: Sequence[str | None]) -> None:
        """Nothing was queued: free the keys this request claimed (best effort; a key left behind is
        taken over by the next request after the wait in `claim`)."""
        names = [keys.idempotency(k) for k in claimed if k]
        if names:
            with contextlib.suppress(redis.RedisError):
                self.redis.delete(*names)

    def _existing(self, key: str, idem: str, job_id: str) -> JobRecord | None:
        owner = cast("bytes | None", self.redis.get(idem))  # a bytes client (no decode_responses)
        deadline = time.monotonic() + RECORDING_WAIT
        while owner is not None and time.monotonic() < deadline:  # the first request may still be recording it
            record = self.jobs.get(owner.decode())
            if record is not None:
                return record
            time.sleep(0.02)
            owner = cast("bytes | None", self.redis.get(idem))
        if owner is None:  # the first request failed and released the key
            return self.claim(key, job_id)
        if self._take_over(idem, owner, job_id):  # the first request died before recording its job
            return None
        raise NotReady("a request with this Idempotency-Key is still being recorded; retry shortly")

    def _take_over(self, idem: str, stale: bytes, job_id: str) -> bool:
        """Move a key to `job_id` if it still names `stale`, a job that was never recorded (its job
        and message are written in the transaction right after the key is claimed, so a key whose job
        has not appeared within the wait belongs to a request that did not get that far)."""
        with self.redis.pipeline() as pipe:
            try:
                pipe.watch(idem, keys.job(stale.decode()))
                if pipe.get(idem) != stale or pipe.exists(keys.job(stale.decode())):
                    return False
                pipe.multi()
                pipe.set(idem, job_id, ex=self.retention)
                pipe.execute()
                return True
            except redis.WatchError:
                return False

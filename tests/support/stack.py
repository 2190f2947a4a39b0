"""A local stack for tests: the same processes `actq run` starts (shared.cli.local_stack), plus
helpers to submit jobs and wait for them over HTTP, and to count what Redis holds."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared import keys
from shared.cli.local_stack import Stack
from shared.states import TERMINAL_NAMES

TINY = "tiny"
SMOL = "smollm2-135m"
TERMINAL = TERMINAL_NAMES


@dataclass
class TestStack(Stack):
    __test__ = False  # not a test class, whatever its name says

    peers: list[Stack] = field(default_factory=list)  # other stacks whose workers use the same Redis

    @property
    def storage_dir(self) -> Path:
        return Path(self.env["ACTQ_STORAGE_URL"].removeprefix("file://"))

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60)

    def submit(self, client: httpx.Client, body: dict, **kwargs: object) -> str:
        response = client.post("/jobs", json=body, **kwargs)  # type: ignore[arg-type]
        assert response.status_code in (200, 202), response.text
        return str(response.json()["id"])

    def wait(self, client: httpx.Client, job_id: str, timeout: float = 120) -> dict:
        deadline, job = time.monotonic() + timeout, None
        while (remaining := deadline - time.monotonic()) > 0:
            job = client.get(f"/jobs/{job_id}", params={"wait": min(remaining, 20)}).json()
            if job["status"] in TERMINAL:
                return job
        raise AssertionError(f"job {job_id} not finished after {timeout}s: {job}; worker log:\n{self.log_tail()}")

    def log_tail(self, name: str = "worker-tiny", chars: int = 4000) -> str:
        return super().log_tail(name, chars)

    def wait_workers(self, timeout: float = 15) -> None:
        """Until every running worker's model is listed live (after a flush, heartbeats re-publish them)."""
        wanted = set(self.models.values()).union(*(peer.models.values() for peer in self.peers))
        deadline = time.monotonic() + timeout
        while True:
            live = httpx.get(f"{self.base_url}/health", timeout=10).json().get("workers", {})
            if all(live.get(model, 0) > 0 for model in wanted):
                return
            assert time.monotonic() < deadline, f"workers for {wanted} not live again: {live}"
            time.sleep(0.05)


def assert_stored_once(storage_dir: Path, job: dict) -> None:
    """A succeeded job's files in a local store: one folder, of the attempt the record names (its
    last claim's), holding its file and manifest.json with the record's sha256; nothing else."""
    folder, key = storage_dir / "jobs" / job["id"], job["activations"]["key"]
    attempt = key.split("/")[2]
    assert key == f"jobs/{job['id']}/{attempt}/activations.safetensors", key
    assert attempt.startswith(f"attempt-{job['attempts']}-"), (attempt, job["attempts"])
    assert [p.name for p in folder.iterdir()] == [attempt], (job["id"], sorted(folder.iterdir()))
    files = sorted(p.name for p in (folder / attempt).iterdir())
    assert files == ["activations.safetensors", "manifest.json"], (job["id"], files)
    assert json.loads((folder / attempt / "manifest.json").read_text())["sha256"] == job["activations"]["sha256"]


def queued_messages(client: redis.Redis, model: str) -> int:
    """Broker messages waiting in a model's queue, in all its lanes."""
    return sum(int(client.llen(lane)) for lane in keys.lanes(model))


def job_count(client: redis.Redis) -> int:
    """Job records in Redis (distinct keys: SCAN may return a key twice while Redis rehashes)."""
    return len(set(client.scan_iter(match=keys.job("*"), count=1000)))

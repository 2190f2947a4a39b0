"""Real components: a redis-server on a free loopback port, real Celery worker processes holding
real models (a tiny random Llama, and the built-in SmolLM2), the real API over HTTP."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

# Keep the developer's own ACTQ_* settings out of the tests; no hub lookups.
for _name in [n for n in os.environ if n.startswith("ACTQ_")]:
    del os.environ[_name]
os.environ["HF_HUB_OFFLINE"] = "1"

from shared import keys, stack  # noqa: E402
from shared.redis_server import RedisServer, free_port  # noqa: E402
from shared.settings import Settings  # noqa: E402

TINY = "tiny"
SMOL = "smollm2-135m"
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    from worker.models import ensure_smollm2

    return ensure_smollm2(Settings().model_cache_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_dir) -> Path:
    from tests.tiny_model import build

    return build(tmp_path_factory.mktemp("models") / TINY, smol_dir)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@dataclass
class Stack:
    base_url: str
    redis_url: str
    storage_dir: Path
    env: dict[str, str]
    logs: dict[str, Path]
    processes: dict[str, object] = field(default_factory=dict)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60)

    def submit(self, client: httpx.Client, body: dict, **kwargs) -> str:
        response = client.post("/jobs", json=body, **kwargs)
        assert response.status_code in (200, 202), response.text
        return response.json()["id"]

    def wait(self, client: httpx.Client, job_id: str, timeout: float = 120) -> dict:
        deadline, job = time.monotonic() + timeout, None
        while (remaining := deadline - time.monotonic()) > 0:
            job = client.get(f"/jobs/{job_id}", params={"wait": min(remaining, 20)}).json()
            if job["status"] in TERMINAL:
                return job
        raise AssertionError(f"job {job_id} not finished after {timeout}s: {job}; worker log:\n{self.log_tail()}")

    def log_tail(self, name: str = "worker-tiny") -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace")[-4000:] if path and path.exists() else ""

    def start_worker(self, name: str, extra_env: dict[str, str], timeout: float = 300):
        self.storage_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.logs.setdefault(f"worker-{name}", self.storage_dir.parent / f"worker-{name}.log")
        process = stack.start_worker({**self.env, **extra_env}, log, name=name)
        self.processes[f"worker-{name}"] = process
        model = extra_env.get("ACTQ_MODEL_NAME") or extra_env.get("ACTQ_MODEL")
        stack.wait_ready(self.base_url, model, [process], timeout, [log])
        return process


@pytest.fixture(scope="session")
def live(tmp_path_factory, redis_server, tiny_dir, smol_dir):
    """API + a worker serving the tiny model. Settings are chosen so tests can reach every limit."""
    root = tmp_path_factory.mktemp("stack")
    storage = root / "data"
    env = {
        "ACTQ_REDIS_URL": redis_server.url,
        "ACTQ_STORAGE_URL": storage.as_uri(),
        "ACTQ_MODEL_CACHE_DIR": str(smol_dir.parent),
        "ACTQ_MAX_TOKENS_LIMIT": "200",
        "ACTQ_DEFAULT_MAX_TOKENS": "16",
        "ACTQ_CAPTURE_BUDGET_BYTES": str(20_000_000),
        "ACTQ_HEARTBEAT_INTERVAL": "1",
        "ACTQ_HEARTBEAT_TTL": "4",
        "HF_HUB_OFFLINE": "1",
    }
    port = free_port()
    s = Stack(base_url=f"http://127.0.0.1:{port}", redis_url=redis_server.url, storage_dir=storage, env=env, logs={})
    s.logs["api"] = root / "api.log"
    s.processes["api"] = stack.start_api(env, s.logs["api"], port)
    try:
        s.start_worker(TINY, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": TINY})
        yield s
    finally:
        for process in s.processes.values():
            stack.stop(process)


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of the test's own, for faults that must not reach the session's Redis."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@contextmanager
def own_stack(root: Path, base_env: dict[str, str], **overrides: str) -> Iterator[Stack]:
    """An API of its own (no worker yet) on `base_env` with `overrides`, e.g. its own Redis or
    store; for tests that break a component and must not disturb the session's stack."""
    root.mkdir(parents=True, exist_ok=True)
    env = {**base_env, "ACTQ_STORAGE_URL": (root / "data").as_uri(), **overrides}
    port = free_port()
    s = Stack(base_url=f"http://127.0.0.1:{port}", redis_url=env["ACTQ_REDIS_URL"], storage_dir=root / "data", env=env, logs={})
    s.logs["api"] = root / "api.log"
    s.processes["api"] = stack.start_api(env, s.logs["api"], port)
    try:
        health_when_up(s.base_url)
        yield s
    finally:
        for process in s.processes.values():
            stack.stop(process)


@pytest.fixture(scope="session")
def live_smol(live):
    """The same stack plus a worker serving the built-in SmolLM2-135M-Instruct."""
    live.start_worker("smol", {"ACTQ_MODEL": SMOL})
    return live


@pytest.fixture
def http(live):
    with live.client() as client:
        yield client


def health_when_up(base_url: str, timeout: float = 20) -> httpx.Response:
    """GET /health of an API process that may still be starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{base_url}/health", timeout=10)
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"{base_url} did not come up"
            time.sleep(0.1)


def queued_messages(client: redis.Redis, model: str) -> int:
    return client.llen(keys.queue(model))


def job_count(client: redis.Redis) -> int:
    return len(set(client.scan_iter(match=keys.job("*"), count=1000)))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    from tests.s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    assert server.endpoint.startswith("http://127.0.0.1:")  # tests never touch a non-local endpoint
    yield server
    server.stop()


@pytest.fixture(scope="session")
def live_s3(live, s3_server, tiny_dir):
    """A second API and a tiny-model worker ("tiny-s3") storing activations in SeaweedFS."""
    root = live.storage_dir.parent / "s3-stack"
    root.mkdir()
    env = {**live.env, **s3_server.env()}
    port = free_port()
    s = Stack(base_url=f"http://127.0.0.1:{port}", redis_url=live.redis_url, storage_dir=root / "unused", env=env, logs={})
    s.logs["api"] = root / "api.log"
    s.processes["api"] = stack.start_api(env, s.logs["api"], port)
    try:
        s.start_worker("tiny-s3", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-s3"})
        yield s
    finally:
        for process in s.processes.values():
            stack.stop(process)

"""The whole stack as deployed: the API as a uvicorn process, Celery workers serving a tiny random
Llama (and, for the slow tests, the built-in SmolLM2), over a Redis of their own. Every test here
starts from an empty job space: Redis is flushed before each test but for the workers' registry
(their models and heartbeats, put back as they were), so no test waits for a heartbeat."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from shared import keys
from shared.cli.redis_server import RedisServer
from tests.support.stack import SMOL, TINY, TestStack

STACK_ENV = {
    "ACTQ_MAX_TOKENS_LIMIT": "200",
    "ACTQ_DEFAULT_MAX_TOKENS": "16",
    "ACTQ_CAPTURE_BUDGET_BYTES": str(20_000_000),
    "ACTQ_HEARTBEAT_INTERVAL": "0.5",
    "ACTQ_HEARTBEAT_TTL": "4",
    "HF_HUB_OFFLINE": "1",
}


@pytest.fixture(scope="session", autouse=True)
def engine_threads() -> Iterator[int]:
    """This process computes its references (forward hooks on a plain model) with the torch threads
    the stack's engine processes use by default: a float sum split over 2 threads rounds apart from
    the same sum on 1, so captures equal the reference bit for bit only at equal thread counts."""
    import torch

    from shared.settings import Settings
    from worker.engine.runtime import torch_threads_for

    before = torch.get_num_threads()
    threads = torch_threads_for(Settings())
    torch.set_num_threads(threads)
    yield threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stack_redis(tmp_path_factory: pytest.TempPathFactory):
    with RedisServer(tmp_path_factory.mktemp("stack-redis")) as server:
        yield server


@pytest.fixture(scope="session")
def live(tmp_path_factory: pytest.TempPathFactory, stack_redis: RedisServer, tiny_dir: Path, smol_dir: Path):
    """API + a worker serving the tiny model. Settings are chosen so tests can reach every limit."""
    root = tmp_path_factory.mktemp("stack")
    env = {
        **STACK_ENV,
        "ACTQ_REDIS_URL": stack_redis.url,
        "ACTQ_STORAGE_URL": (root / "data").as_uri(),
        "ACTQ_MODEL_CACHE_DIR": str(smol_dir.parent),
    }
    with TestStack(root, env) as s:
        s.start_api()
        s.start_worker(TINY, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": TINY})
        yield s


def empty_job_space(client: redis.Redis) -> None:
    """Flush everything but the registry: the served models' descriptions and their workers'
    heartbeats go back as they were (a heartbeat landing meanwhile is overwritten by one as fresh)."""
    registry = [keys.MODELS, *client.scan_iter(keys.model("*")), *client.scan_iter(keys.workers("*"))]
    kept = {key: client.dump(key) for key in registry}
    client.flushdb()
    for key, value in kept.items():
        if value is not None:
            client.restore(key, 0, value, replace=True)


@pytest.fixture(autouse=True)
def redis_client(live: TestStack):
    """The stack's Redis with an empty job space; its workers stay listed (checked, not awaited)."""
    client = redis.Redis.from_url(live.redis_url)
    empty_job_space(client)
    live.wait_workers()
    yield client
    client.close()


@contextmanager
def own_stack(root: Path, base_env: dict[str, str], **overrides: str) -> Iterator[TestStack]:
    """An API of its own (no worker yet) on `base_env` with `overrides`, e.g. its own Redis or
    store; for tests that break a component and must not disturb the session's stack."""
    env = {**base_env, "ACTQ_STORAGE_URL": (root / "data").as_uri(), **overrides}
    with TestStack(root, env) as s:
        s.start_api()
        yield s


@pytest.fixture(scope="session")
def live_smol(live: TestStack) -> TestStack:
    """The same stack plus a worker serving the built-in SmolLM2-135M-Instruct."""
    live.start_worker("smol", {"ACTQ_MODEL": SMOL})
    return live


TOOL_MODEL = "tool-model"


@pytest.fixture(scope="session")
def live_tools(live: TestStack, tool_model_dir: Path) -> TestStack:
    """The same stack plus a worker serving the tiny model trained to call the calculator
    (tests/support/tool_model.py), whose chat template renders tools (Hermes 2 Pro)."""
    live.start_worker(TOOL_MODEL, {"ACTQ_MODEL": str(tool_model_dir), "ACTQ_MODEL_NAME": TOOL_MODEL})
    return live


@pytest.fixture(scope="module")
def client(live: TestStack):
    """The official openai client on the stack's /v1 routes (a module may define its own `client`)."""
    from openai import OpenAI

    with OpenAI(base_url=live.base_url + "/v1", api_key="unused", timeout=120) as c:
        yield c


@pytest.fixture
def http(live: TestStack):
    with live.client() as client:
        yield client


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    from tests.support.s3_server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    assert server.endpoint.startswith("http://127.0.0.1:")  # tests never touch a non-local endpoint
    yield server
    server.stop()


@pytest.fixture(scope="session")
def live_s3(live: TestStack, s3_server, tiny_dir: Path):
    """A second API and a tiny-model worker ("tiny-s3") storing activations in SeaweedFS."""
    root = live.root / "s3-stack"
    with TestStack(root, {**live.env, **s3_server.env()}) as s:
        s.start_api()
        s.start_worker("tiny-s3", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-s3"})
        live.peers.append(s)  # its workers share the session's Redis: wait for them too after a flush
        yield s
        live.peers.remove(s)

"""Fixtures every tier uses. Real components: a redis-server on a free loopback port (flushed
before each test that uses it), real models built at test time. Tiers, by folder:

    tests/shared, tests/api, tests/worker, tests/test_*.py   fast unless marked `model`
    tests/e2e                                                 marked `e2e`: real worker and API processes

`make test-fast` runs `-m "not e2e and not model and not slow"`; `make test` runs everything.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis

# Keep the developer's own ACTQ_* settings out of the tests; no hub lookups.
for _name in [n for n in os.environ if n.startswith("ACTQ_")]:
    del os.environ[_name]
os.environ["HF_HUB_OFFLINE"] = "1"
# One OpenMP thread per test process and per process a test starts, unless the caller chose: with
# torch's default (one per core) three xdist processes on two cores spent a quarter of their CPU
# waiting on each other's threads (tests/worker's model tests: 133 -> 99 s of CPU). Engine processes
# set their own threads either way (worker/engine/runtime.py, `torch_threads_for`), as in production.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from shared.cli.redis_server import RedisServer  # noqa: E402
from shared.settings import Settings  # noqa: E402
from tests.support import durations  # noqa: E402
from tests.support.stack import TINY  # noqa: E402

E2E = Path(__file__).parent / "e2e"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="tests marked `exhaustive` run their whole sweep (make test-exhaustive), not its distinct cases",
    )


SLOW_CALL_SECONDS = 120  # a test's own run (not its fixtures') past this must be marked `slow`


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed and report.duration > SLOW_CALL_SECONDS:
        if item.get_closest_marker("slow") is None:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} ran {report.duration:.0f} s, past {SLOW_CALL_SECONDS} s: make it cheaper "
                "or mark it `slow` (tests/conftest.py)"
            )


TIMELINE = os.environ.get("TEST_TIMELINE")  # a path prefix: each test process notes when each test starts and ends


def _note(what: str, nodeid: str) -> None:
    """With TEST_TIMELINE set: `<time> <start|end> <test>` appended to `<prefix>.<process>`, to see
    which files hold a parallel run's tail (make test's files are spread by xdist's loadfile)."""
    if TIMELINE:
        with open(f"{TIMELINE}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a") as out:
            out.write(f"{time.time():.3f} {what} {nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _note("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _note("end", nodeid)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(E2E):
            item.add_marker(pytest.mark.e2e)
    # Longest files first (tests/support/durations.py): with --no-loadscope-reorder (make test),
    # xdist hands them out in this order. Each file's tests keep theirs.
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [item for name in durations.longest_first(list(by_file), durations.load()) for item in by_file[name]]


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The built-in SmolLM2, converted once into the model cache (about 30 s the first time)."""
    from worker.model.loading import ensure_smollm2

    return ensure_smollm2(Settings().model_cache_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    from tests.support.tiny_model import build

    return build(tmp_path_factory.mktemp("models") / TINY, smol_dir)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """A tiny Llama trained to answer word problems with a calculator call, then the answer
    (tests/support/tool_model.py). Trained once per machine into the cache, keyed by a hash of its
    inputs (a minute or two the first time); each session gets its own copy."""
    import shutil

    from shared.settings import DEFAULT_CACHE_DIR
    from tests.support.tool_model import cached_tool_model

    cached = cached_tool_model(DEFAULT_CACHE_DIR / "test-models", smol_dir)
    return Path(shutil.copytree(cached, tmp_path_factory.mktemp("models") / "tool-model"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer):
    """A client of the tests' Redis, emptied before the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def own_redis(tmp_path: Path):
    """A Redis of the test's own, for faults that must not reach another test's Redis."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()

"""Several workers on one machine, started with the manual's command (docs/operations.md, no
`-n`): each is a Celery node of its own (`celery inspect ping` answers twice, under distinct
names), GET /jobs/{id} names the node that ran the job, a worker that stops leaves the live count
at once and one that is killed within the heartbeat TTL, on the shipped heartbeat settings.
Issue 47: both were `celery@<host>` (one node online), and a stopped worker counted for ~19 s."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest

from shared.broker import make_celery
from shared.cli.local_stack import wait_ready
from shared.settings import Settings
from tests.e2e.conftest import own_stack

MODEL = "tiny-nodes"
DOCS_COMMAND = [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "-E"]  # as the manual runs it


def live_count(base_url: str) -> int:
    return int(httpx.get(f"{base_url}/health", timeout=10).json()["workers"].get(MODEL, 0))


def until(predicate, timeout: float, every: float = 0.05) -> float:
    """Seconds until `predicate()` held (fails after `timeout`)."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"not within {timeout} s"
        time.sleep(every)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def two_workers(live, tiny_dir, tmp_path_factory):
    """An API and two workers of one model on their own Redis, with the shipped heartbeat settings."""
    from shared.cli.redis_server import RedisServer

    root = tmp_path_factory.mktemp("two-workers")
    base = {k: v for k, v in live.env.items() if not k.startswith("ACTQ_HEARTBEAT")}
    with RedisServer(root / "redis") as server, own_stack(root / "stack", base, ACTQ_REDIS_URL=server.url) as s:
        env = {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": MODEL}
        for name in ("worker-a", "worker-b"):
            s.models[name] = MODEL
            s._start(name, DOCS_COMMAND, env)
        wait_ready(s.base_url, MODEL, [s.processes["worker-a"]], 300, [s.logs["worker-a"]])
        until(lambda: live_count(s.base_url) == 2, timeout=300, every=0.2)
        yield s


def test_two_workers_are_two_nodes_and_a_job_names_the_one_that_ran_it(two_workers):
    s = two_workers
    celery = make_celery(Settings(redis_url=s.redis_url))
    deadline = time.monotonic() + 60  # a worker answers once its consumer runs (after its engine is live)
    while True:
        replies = celery.control.ping(timeout=2)  # what `celery inspect ping` asks
        nodes = sorted({name for reply in replies for name in reply})
        if len(nodes) == 2 or time.monotonic() > deadline:
            break
    host = os.uname().nodename
    assert len(nodes) == 2, replies  # two nodes online, not one `celery@<host>`
    assert all(n.startswith(f"actq-{MODEL}-") and n.endswith(f"@{host}") for n in nodes), nodes
    with s.client() as http:
        ids = [
            s.submit(http, {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2})
            for i in range(6)
        ]
        jobs = [s.wait(http, i) for i in ids]
    assert all(j["status"] == "succeeded" for j in jobs)
    assert {j["worker"] for j in jobs} <= set(nodes), ([j["worker"] for j in jobs], nodes)


def test_a_stopped_worker_leaves_the_live_count_at_once_and_a_killed_one_within_seconds(two_workers):
    s = two_workers
    stopping = s.processes["worker-a"]
    os.killpg(stopping.pid, signal.SIGTERM)  # as `stop` and Ctrl-C do: the worker and its engine
    stopped_in = until(lambda: live_count(s.base_url) == 1, timeout=10)
    assert stopped_in < 2.0, stopped_in  # it leaves as it stops (before: once its heartbeat expired, ~20 s)
    stopping.wait(30)
    worker = s.processes["worker-b"]
    os.killpg(worker.pid, signal.SIGKILL)  # the worker and its engine: nothing says goodbye
    killed = time.monotonic()
    worker.wait()
    until(lambda: live_count(s.base_url) == 0, timeout=15)
    gone_in = time.monotonic() - killed
    assert gone_in <= Settings().heartbeat_ttl + 1.0 and gone_in < 6.0, gone_in  # the TTL (4 s), not 20


def test_a_started_worker_is_waited_for_even_when_redis_still_lists_a_gone_one(live, tiny_dir, tmp_path_factory):
    """A Redis kept from a stopped stack (actq serve on its data directory again) lists the old
    worker until its heartbeat expires: starting a worker waits for that worker to be live, not for
    any live worker of its model. Before, `actq serve` said it was serving at once, and GET /health
    showed no worker seconds later (a clean-clone run caught it in test_serve's full-disk test)."""
    import redis

    from shared import keys
    from shared.cli.redis_server import RedisServer
    from shared.registry import ModelRegistry

    root = tmp_path_factory.mktemp("gone-worker")
    model = "tiny-gone"
    with RedisServer(root / "redis") as server, own_stack(root / "stack", live.env, ACTQ_REDIS_URL=server.url) as s:
        client = redis.Redis.from_url(server.url)
        client.sadd(keys.MODELS, model)
        client.zadd(keys.workers(model), {"gone@nowhere": time.time() + 600})  # its last beat, still fresh
        s.start_worker("fresh", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": model})
        live_now = set(ModelRegistry(client, heartbeat_ttl=4).live_workers(model))
        assert live_now - {"gone@nowhere"}, "start_worker returned before its worker was live"

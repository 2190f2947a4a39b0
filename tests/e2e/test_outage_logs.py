"""A Redis outage in the logs (issue 47): the worker's processes and the API each say once that
Redis is unreachable and once that it is back (with how long it was away), not a line per retry,
per request or per 50 ms progress round. Redis is stopped for real while jobs generate and the
API is asked for jobs, then started again; every job still succeeds."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.e2e.conftest import own_stack
from tests.e2e.test_outages import submit_batch, tiny_body, wait_all, wait_running

pytestmark = pytest.mark.slow

DOWN = "Redis is unreachable"
BACK = re.compile(r"Redis is back after (\d+\.\d) s")
NOISE = ("Connection refused", "Error 111", "stamina.retry_scheduled", "backend unavailable", "Trying again")


def test_a_redis_outage_is_one_line_when_it_starts_and_one_when_it_ends(live, tiny_dir, tmp_path, own_redis):
    env = {"ACTQ_REDIS_URL": own_redis.url, "ACTQ_MAX_BATCH": "2"}
    with own_stack(tmp_path / "stack", live.env, **env) as s, s.client() as http:
        s.start_worker("w", {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": "tiny-ol"})
        ids = submit_batch(http, tiny_body("tiny-ol", max_tokens=200), 12)
        wait_running(http, ids[0])  # jobs generate: the engine's progress round runs every 50 ms
        marks = {name: path.stat().st_size for name, path in s.logs.items()}
        own_redis.stop()
        stopped = time.monotonic()
        while time.monotonic() - stopped < 5:  # the API is asked meanwhile: each answer is a 503
            for call in (lambda: http.get(f"/jobs/{ids[-1]}"), lambda: http.post("/jobs", json=tiny_body("tiny-ol"))):
                assert call().status_code == 503
            time.sleep(0.2)
        own_redis.start()
        jobs = wait_all(s, http, ids, timeout=180)
        assert [j["status"] for j in jobs] == ["succeeded"] * len(ids)

        def since_outage(name: str) -> list[str]:
            return s.logs[name].read_bytes()[marks[name] :].decode(errors="replace").splitlines()

        deadline = time.monotonic() + 15  # each process says it is back at its next call to Redis
        while sum(bool(BACK.search(line)) for line in since_outage("worker-w") + since_outage("api")) < 3:
            assert time.monotonic() < deadline, "\n".join(since_outage("worker-w")[-40:] + since_outage("api"))
            time.sleep(0.2)
        assert httpx.get(f"{s.base_url}/health", timeout=10).status_code == 200
        worker, api = since_outage("worker-w"), since_outage("api")
        for process in ("/MainProcess]", "/engine]"):  # the Celery worker process, its engine process
            lines = [line for line in worker if process in line]
            assert sum(DOWN in line for line in lines) == 1, "\n".join(lines)
            back = [float(m.group(1)) for line in lines if (m := BACK.search(line))]
            assert len(back) == 1 and 4.0 <= back[0] < 60, "\n".join(lines)
        assert sum(DOWN in line for line in api) == 1 and sum(bool(BACK.search(line)) for line in api) == 1, api
        noisy = [line for line in worker + api if any(n in line for n in NOISE) and DOWN not in line]
        assert not noisy, "\n".join(noisy[:20])

"""Load: 2,000 jobs from 16 concurrent clients against two tiny-model workers. Every job
succeeds exactly once (one record, one run, one file), none is lost, and the queue drains."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import pytest
import redis

from shared import keys
from tests.e2e.conftest import own_stack
from tests.support.stack import TERMINAL

pytestmark = pytest.mark.slow

CLIENTS, PER_CLIENT = 16, 125
MODEL = "tiny-load"


def test_2000_jobs_from_16_concurrent_clients(live, tiny_dir, tmp_path, own_redis):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 2,
        "capture": {"modules": ["model.layers.1"], "positions": "last"},
    }
    with own_stack(tmp_path / "stack", live.env, ACTQ_REDIS_URL=own_redis.url) as s:
        for name in ("a", "b"):
            s.start_worker(name, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": MODEL})
        ids: list[list[str]] = [[] for _ in range(CLIENTS)]
        finals: list[dict] = []
        errors: list[str] = []
        lock = threading.Lock()

        def client(n: int) -> None:
            try:
                with s.client() as http:
                    for i in range(PER_CLIENT):
                        response = http.post("/jobs", json=body, headers={"Idempotency-Key": f"load-{n}-{i}"})
                        assert response.status_code == 202, response.text
                        ids[n].append(response.json()["id"])
                    for job_id in ids[n]:  # then each client waits for its own jobs
                        deadline = time.monotonic() + 600
                        while (job := http.get(f"/jobs/{job_id}", params={"wait": 20}).json())[
                            "status"
                        ] not in TERMINAL:
                            assert time.monotonic() < deadline, job
                        with lock:
                            finals.append(job)
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(f"client {n}: {exc!r}")

        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        assert not errors, errors[:3]

        every = [job_id for per in ids for job_id in per]
        assert len(every) == len(set(every)) == CLIENTS * PER_CLIENT
        assert len(finals) == CLIENTS * PER_CLIENT
        assert Counter(j["status"] for j in finals) == {"succeeded": CLIENTS * PER_CLIENT}
        assert Counter(j["attempts"] for j in finals) == {1: CLIENTS * PER_CLIENT}
        client_redis = redis.Redis.from_url(own_redis.url)
        assert len(set(client_redis.scan_iter(match=keys.job("*"), count=10_000))) == CLIENTS * PER_CLIENT
        assert not any(client_redis.llen(lane) for lane in keys.lanes(MODEL))
        assert client_redis.zcard(keys.queued(MODEL)) == 0
        client_redis.close()
        # each job ran once, on one of the two workers, and both workers took a share
        runs, shares = Counter(), Counter()
        for name in ("a", "b"):
            found = re.findall(r"job (\S+) claimed \(attempt", s.logs[f"worker-{name}"].read_text(errors="replace"))
            runs.update(found)
            shares[name] = len(found)
        assert set(runs) == set(every) and set(runs.values()) == {1}
        assert min(shares.values()) > 0.2 * len(every), shares
        jobs_dir = s.storage_dir / "jobs"
        assert sum(1 for _ in jobs_dir.iterdir()) == len(every)
        print(
            f"\n2,000 jobs from 16 clients on two tiny workers: {elapsed:.1f} s "
            f"({len(every) / elapsed:.0f} jobs/s), shares {dict(shares)}"
        )

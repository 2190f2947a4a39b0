"""Many long polls on one API process, and what they cost everyone else.

Stack: an embedded Redis and the API under uvicorn (one process). A worker loads the built-in model
once to publish its description and is stopped: the jobs stay queued, so their long polls wait.

1. WAITERS jobs are queued (POST /jobs/batch) and a second process opens WAITERS concurrent
   `GET /jobs/{id}?wait=HOLD`, one per job, each on its own connection.
2. Once all are waiting (measured: the API answers none of them early), this process times
   PROBES sequential `GET /jobs/{id}` of an unrelated job: p50 / p99 / max.
3. Every waited-on job is then failed as a worker would record it; the time until every long
   poll has answered is reported, with the status of every answer (the target: all 200, no 503,
   no 429 below ACTQ_MAX_LONG_POLLS).
4. The same probes with no waiters, for the baseline, in the same run.

    python bench/bench_long_polls.py [--waiters 1000] [--probes 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from shared.cli.local_stack import Stack  # noqa: E402
from shared.cli.redis_server import RedisServer  # noqa: E402
from shared.errors import JobTimeout  # noqa: E402
from shared.jobs import JobStore  # noqa: E402

MODEL = "bench-polls"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _hold(base_url: str, ids: list[str], hold: float) -> list[tuple[int, float]]:
    """The waiters' side (run in a process of its own): one long poll per job, all at once."""
    limits = httpx.Limits(max_connections=len(ids) + 10, max_keepalive_connections=len(ids) + 10)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=hold + 60) as client:

        async def one(job_id: str) -> tuple[int, float]:
            response = await client.get(f"/jobs/{job_id}", params={"wait": hold})
            return response.status_code, time.time()

        return await asyncio.gather(*(one(i) for i in ids))


def _probe(base_url: str, job_id: str, n: int) -> list[float]:
    latencies = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for _ in range(n):
            start = time.perf_counter()
            response = client.get(f"/jobs/{job_id}")
            latencies.append((time.perf_counter() - start) * 1e3)
            assert response.status_code == 200, response.text
    return latencies


def _summary(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": ordered[-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--probes", type=int, default=300)
    parser.add_argument("--hold", type=float, default=60.0, help="the waiters' `wait` (seconds)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hold-child", nargs=2, metavar=("BASE_URL", "IDS_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold_child:  # the waiters' process
        base_url, ids_file = args.hold_child
        answers = asyncio.run(_hold(base_url, json.loads(Path(ids_file).read_text()), args.hold))
        print(json.dumps(answers))
        return 0

    with tempfile.TemporaryDirectory(prefix="actq-bench-polls-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        tmp_path = Path(tmp)
        env = {"ACTQ_REDIS_URL": server.url, "ACTQ_STORAGE_URL": (tmp_path / "data").as_uri(), "ACTQ_MODEL_NAME": MODEL}
        with Stack(tmp_path / "setup", env) as setup:  # publishes the model's description, then goes
            setup.start_api(wait=False)
            setup.start_worker("bench", timeout=600)
        with Stack(tmp_path / "api", env) as api:
            api.start_api(1)
            base = api.base_url
            ids = []
            for start in range(0, args.waiters + 1, 1000):
                count = min(1000, args.waiters + 1 - start)
                batch = httpx.post(f"{base}/jobs/batch", json={"jobs": [{"request": BODY}] * count}, timeout=60)
                ids += [j["id"] for j in batch.json()["jobs"]]
            unrelated, waited = ids[0], ids[1:]
            _probe(base, unrelated, 50)  # warm-up
            baseline = _probe(base, unrelated, args.probes)

            ids_file = tmp_path / "ids.json"
            ids_file.write_text(json.dumps(waited))
            child = subprocess.Popen(
                [sys.executable, __file__, "--hold", str(args.hold), "--hold-child", base, str(ids_file)],
                stdout=subprocess.PIPE,
                text=True,
            )
            time.sleep(max(3.0, args.waiters / 250))  # every long poll is in and waiting
            assert child.poll() is None, "the waiters' process ended early"
            loaded = _probe(base, unrelated, args.probes)
            import redis

            client = redis.Redis.from_url(server.url)
            store = JobStore(client, 3600)
            released = time.time()
            for job_id in waited:
                store.fail(job_id, JobTimeout("ended by the benchmark"))
            out, _ = child.communicate(timeout=args.hold + 120)
            answers = json.loads(out)
            client.close()

    statuses: dict[str, int] = {}
    for status, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    report = {
        "command": " ".join(["python", *sys.argv]),
        "waiters": len(waited),
        "probes": args.probes,
        "unrelated GET /jobs/{id}, no waiters": _summary(baseline),
        f"unrelated GET /jobs/{{id}}, {len(waited)} waiting": _summary(loaded),
        "long-poll answers by status": statuses,
        "all long polls answered, seconds after their jobs ended": max(t for _, t in answers) - released,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ok = statuses == {"200": len(waited)} and _summary(loaded)["p99_ms"] < 100
    print("PASS" if ok else "FAIL", "(target: every long poll 200, unrelated GET p99 < 100 ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""API throughput under a load generator: POST /jobs and GET /jobs/{id}, measured with wrk.

Stack: an embedded Redis (append-only, as deployed) and the API under uvicorn, with 1 and with 2
processes (`uvicorn --workers N`). A worker loads the built-in model once to publish its
description and is stopped before the load starts: the jobs stay queued and no model competes for
the machine's cores. wrk (Debian's package `wrk`) runs on the same machine with 2 threads and
16 connections, DURATION seconds per arm after a warm-up; the arms are interleaved over ROUNDS
rounds and medians reported: requests per second and wrk's p50/p99 latency.

Checks that make the numbers mean something: every answer was a 2xx (wrk counts the others), and
after the POST arms the Redis queue holds exactly one message per job record.

    python bench/bench_api.py [--rounds 3] [--duration 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from shared import keys  # noqa: E402
from shared.cli.local_stack import Stack  # noqa: E402
from shared.cli.redis_server import RedisServer  # noqa: E402

MODEL = "bench-api"
BODY = {
    "model": MODEL,
    "messages": [
        {"role": "user", "content": "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"}
    ],
    "max_tokens": 64,
    "capture": {"modules": ["model.layers.{8,15,22}"], "positions": "generated", "dtype": "float16"},
}
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk(url: str, duration: float, connections: int, script: Path | None = None) -> dict:
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{duration:g}s", "--latency", url]
    if script is not None:
        cmd[1:1] = ["-s", str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    def latency(pct: str) -> float:
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)$", out, re.M).groups()
        return float(value) * _UNITS[unit]

    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "p50_ms": latency("50"),
        "p99_ms": latency("99"),
        "non_2xx": int(bad.group(1)) if bad else 0,
        "socket_errors": sum(map(int, errors.groups())) if errors else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="API processes to measure")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk); nothing measured")
        return 0

    with tempfile.TemporaryDirectory(prefix="actq-bench-api-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        tmp_path = Path(tmp)
        env = {
            "ACTQ_REDIS_URL": server.url,
            "ACTQ_STORAGE_URL": (tmp_path / "data").as_uri(),
            "ACTQ_MODEL_NAME": MODEL,
            "ACTQ_MAX_TOKENS_LIMIT": "256",
            "ACTQ_MAX_QUEUED_JOBS_PER_KEY": "0",  # no worker runs them: tens of thousands stay queued
        }
        # One worker publishes the model's description, then goes: the jobs below stay queued.
        with Stack(tmp_path / "setup", env) as setup:
            setup.start_api(wait=False)
            setup.start_worker("bench", timeout=600)
        client = redis.Redis.from_url(server.url)
        script = tmp_path / "post.lua"
        script.write_text(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = [[{json.dumps(BODY)}]]\n"
        )
        results: dict[str, dict[str, list[dict]]] = {}
        for processes in args.processes:
            with Stack(tmp_path / f"api-{processes}", env) as api:
                api.start_api(processes)
                base = api.base_url
                job_id = httpx.post(f"{base}/jobs", json=BODY).json()["id"]
                wrk(f"{base}/jobs", 2, args.connections, script)  # warm-up: connections, caches
                wrk(f"{base}/jobs/{job_id}", 2, args.connections)
                arms = results.setdefault(
                    f"{processes} process{'es' if processes > 1 else ''}", {"POST /jobs": [], "GET /jobs/{id}": []}
                )
                for _ in range(args.rounds):
                    arms["POST /jobs"].append(wrk(f"{base}/jobs", args.duration, args.connections, script))
                    arms["GET /jobs/{id}"].append(wrk(f"{base}/jobs/{job_id}", args.duration, args.connections))
        jobs = len(set(client.scan_iter(match=keys.job("*"), count=10_000)))
        messages = sum(client.llen(lane) for lane in keys.lanes(MODEL))
        client.close()

    report: dict = {
        "connections": args.connections,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "jobs_recorded": jobs,
        "messages_queued": messages,
        "arms": {},
    }
    ok = jobs == messages
    print(
        f"{'API':<12} {'endpoint':<16} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}  (medians of {args.rounds} x {args.duration:g} s, {args.connections} connections)"
    )
    for api_name, arms in results.items():
        for endpoint, runs in arms.items():
            summary = {
                "rps": statistics.median(r["rps"] for r in runs),
                "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r in runs),
                "non_2xx": sum(r["non_2xx"] for r in runs),
                "socket_errors": sum(r["socket_errors"] for r in runs),
                "runs": runs,
            }
            ok &= summary["non_2xx"] == 0 and summary["socket_errors"] == 0
            report["arms"][f"{api_name} {endpoint}"] = summary
            print(
                f"{api_name:<12} {endpoint:<16} {summary['rps']:>8.0f} {summary['p50_ms']:>8.1f} {summary['p99_ms']:>8.1f}"
            )
    print(
        f"jobs recorded {jobs}, messages queued {messages}; non-2xx and socket errors: "
        f"{sum(a['non_2xx'] + a['socket_errors'] for a in report['arms'].values())}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""/health while the heaviest and the most hostile requests of each kind arrive (issue 33).

Stack: an embedded Redis and one API process (uvicorn), with two models published as workers
publish them and no worker: `tiny` (the tests' tiny Llama, 256 tokens of context) and `wide` (the
same with a context that holds tools at the schema budget). For each case, two sender processes
(niced, as in tests/e2e/test_responsiveness.py; `--senders`) post it back to back for DURATION seconds while
this process probes GET /health every 10 ms; reported per case: the senders' requests, /health
p50, p99 and max (status 0: the connection dropped). Accepted cases carry an Idempotency-Key, so every send is checked in full and
only the first queues a job.

The cases are tests/support/hostile.py's: HEAVIEST (accepted at their limits) and SURFACE (the
issue's findings, refused). The script talks HTTP only, so it measures any commit of the API:
run it from a checkout of the commit to compare (`--only` picks cases by substring).

    python bench/bench_hostile.py [--duration 5] [--only tools] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from shared.cli.local_stack import Stack  # noqa: E402
from shared.cli.redis_server import RedisServer  # noqa: E402
from shared.registry import ModelRegistry  # noqa: E402
from shared.tools import ToolFormat  # noqa: E402
from tests.support.hostile import HEAVIEST, SURFACE, WIDE  # noqa: E402
from tests.support.models import tiny_llama  # noqa: E402

SENDER = """
import sys, time, httpx
base, path, body_file, key, seconds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
body = open(body_file, "rb").read()
headers = {"content-type": "application/json", **({"Idempotency-Key": key} if key else {})}
sent, statuses = 0, set()
http = httpx.Client(base_url=base, timeout=120)
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        statuses.add(http.post(path, content=body, headers=headers).status_code)
    except httpx.HTTPError:  # the connection dropped (a bare 500 closes it): 0, and a new connection
        statuses.add(0)
        http.close()
        http = httpx.Client(base_url=base, timeout=120)
    sent += 1
print(sent, *sorted(statuses))
"""


def measure(
    base: str, folder: Path, case: str, path: str, payload: dict, key: str, seconds: float, senders: int
) -> dict:
    body = folder / "body.json"
    body.write_bytes(json.dumps(payload).encode())
    cmd = [sys.executable, "-c", SENDER, base, path, str(body), key, str(seconds)]
    latencies: list[float] = []
    with httpx.Client(base_url=base, timeout=30) as http:
        http.get("/health")
        running = [
            subprocess.Popen(["nice", "-n", "10", *cmd], stdout=subprocess.PIPE, text=True) for _ in range(senders)
        ]
        while any(s.poll() is None for s in running):
            started = time.perf_counter()
            http.get("/health").raise_for_status()
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    outs = [s.communicate()[0].split() for s in running]
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    return {
        "case": case,
        "path": path,
        "bytes": body.stat().st_size,
        "requests": sum(int(o[0]) for o in outs),
        "statuses": sorted({int(x) for o in outs for x in o[1:]}),
        "probes": len(latencies),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": p99 * 1e3,
        "max_ms": max(latencies) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of sending per case")
    parser.add_argument("--only", default="", help="cases whose name holds this text")
    parser.add_argument("--path", default="", help="cases whose route starts with this (e.g. /jobs)")
    parser.add_argument("--senders", type=int, default=2, help="processes sending the case back to back")
    parser.add_argument("--max-request-bytes", type=int, help="ACTQ_MAX_REQUEST_BYTES for the API (default: its own)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = [(c, p, b, f"bench-{i}") for i, (c, p, b) in enumerate(HEAVIEST)]
    cases += [(c, p, b, "") for c, p, b, _ in SURFACE]
    cases = [case for case in cases if args.only in case[0] and case[1].startswith(args.path)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="actq-bench-hostile-") as tmp, RedisServer(Path(tmp) / "redis") as server:
        registry = ModelRegistry(redis.Redis.from_url(server.url), 3600)
        # what a worker that renders tools publishes (the fields an older commit lacks are left out)
        tools = {"tool_format": ToolFormat.HERMES, "special_tokens": ["<|im_start|>", "<|im_end|>"]}
        for info in (tiny_llama(), tiny_llama(WIDE).model_copy(update={"max_context": 1 << 20})):
            info = info.model_copy(update={k: v for k, v in tools.items() if k in type(info).model_fields})
            registry.publish(info)
            registry.heartbeat(info, f"bench-{info.name}")
        env = {"ACTQ_REDIS_URL": server.url, "ACTQ_STORAGE_URL": (Path(tmp) / "data").as_uri()}
        if args.max_request_bytes:
            env["ACTQ_MAX_REQUEST_BYTES"] = str(args.max_request_bytes)
        with Stack(Path(tmp) / "stack", env) as stack:
            stack.start_api()
            for case, path, payload, key in cases:
                row = measure(stack.base_url, Path(tmp), case, path, payload, key, args.duration, args.senders)
                rows.append(row)
                print(
                    f"{case:55} {path:21} {row['bytes'] / 1e3:8.0f} KB {row['requests']:5} req {row['statuses']} "
                    f"/health p50 {row['p50_ms']:6.1f} p99 {row['p99_ms']:7.1f} max {row['max_ms']:7.1f} ms",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

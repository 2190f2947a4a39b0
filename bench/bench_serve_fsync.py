"""What `actq serve`'s `appendfsync always` costs POST /jobs, against Redis's default `everysec`.

Two embedded Redis servers (append-only, their directories on the disk under the repository, not
/tmp), one per setting, each with one API process (uvicorn); a worker publishes the built-in
model's description once and goes. 16 concurrent httpx clients in this process POST jobs for
DURATION seconds per arm; the arms are interleaved over ROUNDS rounds and medians reported
(requests per second, p50 and p99 latency). Every answer must be 202.

    python bench/bench_serve_fsync.py [--rounds 5] [--duration 5]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_api import BODY, MODEL
from shared.cli.local_stack import Stack
from shared.cli.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent


async def load(base: str, seconds: float, concurrency: int = 16) -> tuple[float, float, float]:
    done: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        end = time.monotonic() + seconds

        async def one() -> None:
            while time.monotonic() < end:
                started = time.monotonic()
                response = await client.post("/jobs", json=BODY)
                assert response.status_code == 202, response.text
                done.append(time.monotonic() - started)

        await asyncio.gather(*(one() for _ in range(concurrency)))
    done.sort()
    return len(done) / seconds, done[len(done) // 2] * 1000, done[int(len(done) * 0.99)] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix=".bench-fsync-", dir=ROOT))
    results: dict[str, list[tuple[float, float, float]]] = {"everysec": [], "always": []}
    servers = {mode: RedisServer(root / mode, appendfsync=mode).start() for mode in results}
    stacks: dict[str, Stack] = {}
    try:
        for mode, server in servers.items():
            env = {
                "ACTQ_REDIS_URL": server.url,
                "ACTQ_STORAGE_URL": (root / "data").as_uri(),
                "ACTQ_MODEL_NAME": MODEL,
                "ACTQ_MAX_TOKENS_LIMIT": "256",
                "ACTQ_MAX_QUEUED_JOBS_PER_KEY": "0",
            }
            with Stack(root / f"setup-{mode}", env) as setup:
                setup.start_api(wait=False)
                setup.start_worker("bench", timeout=600)
            stacks[mode] = Stack(root / f"api-{mode}", env)
            stacks[mode].start_api()
            asyncio.run(load(stacks[mode].base_url, 1))  # warm-up
        for _ in range(args.rounds):
            for mode, stack in stacks.items():
                results[mode].append(asyncio.run(load(stack.base_url, args.duration)))
    finally:
        for stack in stacks.values():
            stack.stop()
        for server in servers.values():
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    for mode, rounds in results.items():
        print(
            f"appendfsync {mode}: POST /jobs {statistics.median(r[0] for r in rounds):.0f} req/s "
            f"(rounds {', '.join(f'{r[0]:.0f}' for r in rounds)}), p50 {statistics.median(r[1] for r in rounds):.1f} ms, "
            f"p99 {statistics.median(r[2] for r in rounds):.1f} ms"
        )


if __name__ == "__main__":
    main()

"""Nothing a request says can hold the API's event loop: while two other processes send the worst
hostile requests back to back (huge and deeply nested bodies, capture lists built to expand to
millions of paths, distinct or repeated, paths that name nothing), GET /health (served by the
same API process) stays fast."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from shared.registry import ModelRegistry
from shared.tools import ToolFormat
from tests.support.hostile import HEAVIEST, HOSTILE, SURFACE, WIDE
from tests.support.models import tiny_llama

# The target is 50 ms: with two senders at full speed (niced), p99 38.8 and 40.0 ms here while
# other work ran on the same 2 cores. In the full suite the machine also runs the session's
# workers, Flower and SeaweedFS, and the p99 with one sender ranged 18-66 ms over CI runs, so the
# test's bound is 75 ms beyond what the machine itself costs any process's answer at the same
# moments: each /health probe is followed by a PING to the session's Redis (another process, no
# Python, no work to speak of), and the bound is 75 ms plus twice that canary's p99 (about 2 ms on a
# quiet machine). A machine too busy to give any process the CPU in time shows in both, and weighs
# more on /health: its answer waits for the API's event loop thread and for the GIL, which the
# process's own check threads hold while the OS has them descheduled (in the full suite beside a
# second busy process: /health 108 ms against a canary of 25 ms). What it guards against, one
# request holding the event loop (a capture list expanded path by path cost 8-20 ms a request and
# pushed the p99 past 110 ms on a quiet machine; a 20 ms sleep injected on the loop for each POST:
# 121 ms against a canary of 1.7 ms), shows far above it.
P99_LIMIT_S = 0.075
CANARY_WEIGHT = 2  # how much more a machine-wide wait delays /health than a Redis PING (see above)
ROUNDS = 150  # per sender; about 320 probes: the p99 is the 4th-largest sample, not the 2nd (one scheduler hiccup)
PARSE_FLOOR_BYTES = 1 << 20
HEAVY_ROUNDS = 3  # per sender: each round is seconds of checks; 600-900 probes in all (CI: 1,237-1,796 at 6)

# The sender is a process of its own: its JSON and HTTP work must not hold this process's GIL
# while it times the probes. Each case: (name, path, acceptable statuses, headers).
SENDER = """
import json, sys, httpx
base, folder, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = json.load(open(f"{folder}/cases.json"))
bodies = [open(f"{folder}/{i}.json", "rb").read() for i in range(len(cases))]
wrong = []
with httpx.Client(base_url=base, timeout=120, headers={"content-type": "application/json"}) as http:
    for _ in range(rounds):
        for (case, path, statuses, headers), body in zip(cases, bodies):
            response = http.post(path, content=body, headers=headers)
            if response.status_code not in statuses:
                wrong.append(f"{case} {path}: {response.status_code} {response.text[:200]}")
print(json.dumps(wrong))
"""


def probe_health(
    base_url: str, canary: redis.Redis, folder: Path, cases: list, bodies: list[bytes], rounds: int
) -> tuple[list[float], list[float]]:
    """/health latencies while two niced senders post `cases` back to back, `rounds` times each,
    and beside each probe the `canary`'s (a Redis PING: what the machine costs any answer then)."""
    for i, body in enumerate(bodies):
        (folder / f"{i}.json").write_bytes(body)
    (folder / "cases.json").write_text(json.dumps(cases))
    cmd = [sys.executable, "-c", SENDER, base_url, str(folder), str(rounds)]
    latencies: list[float] = []
    pings: list[float] = []
    with httpx.Client(base_url=base_url, timeout=10) as http:
        http.get("/health")  # warm the connection
        # The senders run at a lower priority: on 2 cores, two senders at full speed would otherwise
        # take the CPU from the API itself, and the probes would time the machine, not the API.
        senders = [subprocess.Popen(["nice", "-n", "10", *cmd], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        while any(sender.poll() is None for sender in senders):
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            answered = time.perf_counter()
            assert canary.ping()
            latencies.append(answered - started)
            pings.append(time.perf_counter() - answered)
            time.sleep(0.01)
    for sender in senders:
        out, _ = sender.communicate()
        assert sender.returncode == 0 and json.loads(out) == []
    assert len(latencies) >= 50, "the hostile requests were answered too fast to measure anything"
    return latencies, pings


def assert_fast(probe: Callable[[], tuple[list[float], list[float]]], what: str) -> None:
    """/health's p99 under `what` within P99_LIMIT_S of twice the canary's p99 (see P99_LIMIT_S),
    in one of two measurements. A request that holds the event loop costs every measurement the
    same; a machine's load comes and goes, and the canary does not see all of it (a CI run of
    twice the usual length: /health p50 25.7 ms, p99 122.9 ms against a canary of 9.9 ms, the
    process's check threads descheduled while holding the GIL). So one measurement over the bound
    is measured again, and both must be over it to fail."""
    misses = []
    for _ in range(2):
        latencies, pings = probe()
        p99 = p99_of(latencies, f"/health during {what}")
        canary = p99_of(pings, f"Redis PING beside each /health probe during {what}")
        if p99 < P99_LIMIT_S + CANARY_WEIGHT * canary:
            return
        misses.append(f"p99 {p99 * 1e3:.1f} ms (the canary's {canary * 1e3:.1f} ms)")
    raise AssertionError(f"/health during {what}, measured twice: {'; '.join(misses)}")


def p99_of(latencies: list[float], what: str) -> float:
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    print(
        f"\n{what}: {len(latencies)} probes, p50 {statistics.median(latencies) * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms, max {max(latencies) * 1e3:.1f} ms"
    )
    return p99


def test_health_stays_fast_while_hostile_requests_arrive(live, redis_client, tmp_path: Path):
    cases, bodies = [], []
    for case, payload, raw, statuses in HOSTILE:
        bodies.append(raw or json.dumps(payload).encode())
        cases.append((case, "/jobs/batch" if payload and "jobs" in payload else "/jobs", list(statuses), {}))
    assert_fast(lambda: probe_health(live.base_url, redis_client, tmp_path, cases, bodies, ROUNDS), "hostile requests")


def test_health_stays_fast_while_the_heaviest_requests_of_the_new_surface_arrive(live, redis_client, tmp_path: Path):
    """Issue 33: tools and schemas at their limits (accepted, and checked in full at every send)
    and the refused schema bombs: each is checked off the event loop, so /health, served by the
    same process, stays fast. (Before: a 2.7 MB request of 100 tools held the loop 3 s, and
    /health's p99 was 1,935 ms.) Bodies over PARSE_FLOOR_BYTES are left to bench/bench_hostile.py:
    parsing one holds the GIL (about 9 ms per MB of small JSON values) wherever it runs, so what
    they cost /health is the body limit's to bound (RELIABILITY.md)."""
    wide = tiny_llama(WIDE).model_copy(update={"max_context": 1 << 20, "tool_format": ToolFormat.HERMES})
    ModelRegistry(redis_client, 60).publish(wide)  # no worker: its jobs stay queued, its /v1 waits end in 504
    cases, bodies = [], []
    for index, (case, path, payload) in enumerate(HEAVIEST):
        accepted = [200, 202] if path.startswith("/jobs") else [504]
        cases.append((case, path, accepted, {"Idempotency-Key": f"heaviest-{index}"}))
        bodies.append(json.dumps(payload).encode())
    for case, path, payload, statuses in SURFACE:
        cases.append((case, path, list(statuses), {}))
        bodies.append(json.dumps(payload).encode())
    kept = [i for i, body in enumerate(bodies) if len(body) <= PARSE_FLOOR_BYTES]
    assert len(kept) >= 20
    cases, bodies = [cases[i] for i in kept], [bodies[i] for i in kept]
    assert_fast(
        lambda: probe_health(live.base_url, redis_client, tmp_path, cases, bodies, HEAVY_ROUNDS),
        "the heaviest requests",
    )

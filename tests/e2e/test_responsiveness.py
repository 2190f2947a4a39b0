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
from pathlib import Path

import httpx

from tests.support.hostile import HOSTILE

# The target is 50 ms: with two senders at full speed (niced), p99 38.8 and 40.0 ms here while
# other work ran on the same 2 cores. In the full suite the machine also runs the session's
# workers, Flower and SeaweedFS, and the p99 with one sender ranged 18-66 ms over CI runs, so the
# test's bound is 75 ms: what it guards against, one request holding the event loop (a capture
# list expanded path by path cost 8-20 ms a request and pushed the p99 past 110 ms), shows far
# above it.
P99_LIMIT_S = 0.075
ROUNDS = 150  # per sender; about 320 probes: the p99 is the 4th-largest sample, not the 2nd (one scheduler hiccup)

# The sender is a process of its own: its JSON and HTTP work must not hold this process's GIL
# while it times the probes.
SENDER = """
import json, sys, httpx
base, folder, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
cases = json.load(open(f"{folder}/cases.json"))
bodies = [open(f"{folder}/{i}.json", "rb").read() for i in range(len(cases))]
wrong = []
with httpx.Client(base_url=base, timeout=60, headers={"content-type": "application/json"}) as http:
    for _ in range(rounds):
        for (case, path, statuses), body in zip(cases, bodies):
            status = http.post(path, content=body).status_code
            if status not in statuses:
                wrong.append(f"{case}: {status}")
print(json.dumps(wrong))
"""


def test_health_stays_fast_while_hostile_requests_arrive(live, tmp_path: Path):
    cases = []
    for i, (case, payload, raw, statuses) in enumerate(HOSTILE):
        (tmp_path / f"{i}.json").write_bytes(raw or json.dumps(payload).encode())
        cases.append((case, "/jobs/batch" if payload and "jobs" in payload else "/jobs", list(statuses)))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    cmd = [sys.executable, "-c", SENDER, live.base_url, str(tmp_path), str(ROUNDS)]
    latencies: list[float] = []
    with httpx.Client(base_url=live.base_url, timeout=10) as http:
        http.get("/health")  # warm the connection
        # The senders run at a lower priority: on 2 cores, two senders at full speed would otherwise
        # take the CPU from the API itself, and the probes would time the machine, not the API.
        senders = [subprocess.Popen(["nice", "-n", "10", *cmd], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        while any(sender.poll() is None for sender in senders):
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    for sender in senders:
        out, _ = sender.communicate()
        assert sender.returncode == 0 and json.loads(out) == []
    assert len(latencies) >= 50, "the hostile requests were answered too fast to measure anything"
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    p50 = statistics.median(latencies)
    print(f"\n/health during hostile requests: {len(latencies)} probes, p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    assert p99 < P99_LIMIT_S, f"p99 {p99 * 1e3:.1f} ms"

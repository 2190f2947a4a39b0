"""The engine gives freed heap memory back to the system after each job (worker/model/memory.py):
at once, or, when jobs end faster than one per TRIM_INTERVAL_S, once at the interval's end. Real
glibc in a child process: the heap is filled and freed with automatic trimming off (as a busy
process's fragmented heap is), and the resident size says when the memory went back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, time
    from worker.model import memory

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    def churn():  # 192 MiB of 64 KiB blocks on the heap, then freed (the last one kept: the heap's top stays)
        blocks = [bytearray(64 << 10) for _ in range(3072)]
        keep = blocks[-1]
        del blocks
        return keep

    memory.TRIM_INTERVAL_S = 3.0
    seen = {"start": rss_mb()}
    kept = [churn()]
    seen["freed"] = rss_mb()
    memory.release_memory_soon()  # the first trim: now
    seen["trimmed"] = rss_mb()
    kept.append(churn())
    seen["freed again"] = rss_mb()
    for _ in range(100):  # within the interval: one trim is due at its end, none now
        memory.release_memory_soon()
    seen["within"] = rss_mb()
    waited = time.monotonic()
    while rss_mb() > seen["trimmed"] + 32 and time.monotonic() - waited < 30:
        time.sleep(0.05)
    seen["later"], seen["waited"] = rss_mb(), time.monotonic() - waited
    print(json.dumps(seen))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_freed_heap_goes_back_at_once_then_at_most_once_per_interval():
    env = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_ARENA_MAX": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["freed"] > seen["start"] + 150, seen  # freed, not given back: malloc keeps it
    assert seen["trimmed"] < seen["freed"] - 150, seen  # the first call trimmed at once
    assert seen["freed again"] > seen["trimmed"] + 150, seen
    assert seen["within"] > seen["trimmed"] + 150, seen  # 100 calls within the interval: no trim yet
    assert seen["later"] < seen["trimmed"] + 32, seen  # the one due at the interval's end ran
    assert 1.0 < seen["waited"] < 20, seen

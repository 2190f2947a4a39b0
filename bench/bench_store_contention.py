"""What storing capture jobs beside the engine thread costs it: in its process, or in another.

A loop of small torch ops on one thread (a decoding step's pattern on a tiny model: matmul,
activation, elementwise, a reduction; one torch thread) counts its steps per second, side by
side in one run:

  alone           nothing else runs
  beside thread   a thread of the same process writes capture jobs without pause: actq's own
                  `write_activations` (a safetensors file of 55 column ranges of one arena, as
                  a job capturing every module of the tiny model at 64 positions keeps, hashed,
                  renamed into a local store, its manifest beside it)
  beside process  the same writes in a process of its own (what ACTQ_STORE_PROCESS does with
                  them: worker/results/store_process.py)

Prints each arm's steps/s (median of `--runs`, interleaved) over `alone`, and the jobs written per
second beside it. On a machine with a core free for the writer, the process arm leaves the loop
its speed; the thread arm takes it back at every torch op's return (the one GIL).

    .venv/bin/python bench/bench_store_contention.py [--runs 3] [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDTHS = ([64] * 8 + [32] * 2 + [256] * 3) * 4 + [64] * 3  # the tiny Llama's 55 modules' widths


def generation():
    """A job's captured tensors as the engine hands them over: column ranges of one arena."""
    from shared.schemas import CapturePoint
    from worker.batch.generation import CapturedTensor, Generation

    arena = torch.randn(64, sum(WIDTHS))
    captured, offset = [], 0
    for i, width in enumerate(WIDTHS):
        point = CapturePoint(module=f"model.layers.{i}", hook="output", name=f"model.layers.{i}")
        captured.append(CapturedTensor(point, arena[:, offset : offset + width], 100, 164))
        offset += width
    return Generation("x", "length", 100, 64, torch.arange(164), captured)


def write_jobs(root: Path, stop: threading.Event | None, counted: list[int], until: float | None = None) -> None:
    """Write capture jobs into a local store at `root` until `stop` is set (or `until` passes)."""
    from shared.schemas import CaptureSpec
    from shared.storage.local import LocalStore
    from worker.results.artifacts import write_activations

    store, spec, job = LocalStore(root), CaptureSpec(modules=["x"], positions="generated"), generation()
    while not (stop is not None and stop.is_set()) and (until is None or time.monotonic() < until):
        n = counted[0]
        write_activations(store, f"job{n % 64}", "tiny", spec, job, prefix=f"jobs/job{n % 64}/attempt-{n}-w")
        counted[0] += 1


def steps(seconds: float, beside: str, root: Path) -> tuple[float, float]:
    """(the loop's steps/s, jobs written/s) with `beside` ("alone", "thread", "process") running."""
    stop, counted = threading.Event(), [0]
    x, w = torch.randn(32, 64), torch.randn(64, 64)
    writer: threading.Thread | subprocess.Popen | None = None
    if beside == "thread":
        writer = threading.Thread(target=write_jobs, args=(root, stop, counted))
        writer.start()
    elif beside == "process":
        command = [sys.executable, __file__, "--writer", str(root), str(seconds + 1.0)]
        writer = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # its imports, before the loop is timed
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(100):
            y = torch.nn.functional.silu(x @ w) * 1.5
            x = (y + x) / 2
            x.sum()
        count += 1
    elapsed = time.perf_counter() - started
    stop.set()
    if isinstance(writer, threading.Thread):
        writer.join()
        jobs = counted[0] / elapsed
    elif isinstance(writer, subprocess.Popen):
        out, _ = writer.communicate()
        jobs = float(out.split()[-1]) / (seconds + 1.0)
    else:
        jobs = 0.0
    return count / elapsed, jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--writer", nargs=2, help=argparse.SUPPRESS)  # the process arm's writer: ROOT SECONDS
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.writer:
        counted = [0]
        write_jobs(Path(args.writer[0]), None, counted, time.monotonic() + float(args.writer[1]))
        print(counted[0])
        return 0
    rows: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="actq-bench-contention-") as tmp:
        for run in range(args.runs):
            for arm in ("alone", "thread", "process"):
                rows.setdefault(arm, []).append(steps(args.seconds, arm, Path(tmp) / f"{arm}-{run}"))
    alone = statistics.median(r[0] for r in rows["alone"])
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"{len(os.sched_getaffinity(0))} cores; load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    print(f"{'arm':<16}{'steps/s':>9}{'x alone':>9}{'jobs/s':>9}   runs (steps/s)")
    for arm, runs in rows.items():
        rate = statistics.median(r[0] for r in runs)
        jobs = statistics.median(r[1] for r in runs)
        each = ", ".join(f"{r[0]:.0f}" for r in runs)
        print(f"{'beside ' + arm if arm != 'alone' else arm:<16}{rate:>9.0f}{rate / alone:>9.2f}{jobs:>9.1f}   {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

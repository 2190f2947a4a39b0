"""bench/bench_gpu.py's smoke run (`--allow-cpu`, CUDA hidden from it) prints its whole table."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADER = [
    "batch",
    "generate tok/s",
    "eager tok/s",
    "graphs tok/s",
    "capture tok/s",
    "edit tok/s",
    "graphs/generate",
    "capture/graphs",
    "edit/graphs",
]
ROW = re.compile(r"^\s*(\d+)" + r"\s+(\S+)" * (len(HEADER) - 1) + r"\s*$")


@pytest.mark.model  # the script builds and loads a tiny model (SmolLM2's tokenizer: the smol_dir fixture)
def test_bench_gpu_smoke_run_prints_every_batch_row(smol_dir):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU smoke run, even on a GPU machine
    done = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--allow-cpu", "--max-tokens", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["batch"])
    assert all(column in lines[header] for column in HEADER), lines[header]
    rows = {}
    for line in lines[header + 1 :]:
        match = ROW.match(line)
        assert match, line
        figures = [float(value) for value in match.groups()[1:]]
        assert all(math.isfinite(f) and f > 0 for f in figures), line
        rows[int(match.group(1))] = figures
    assert sorted(rows) == [1, 2], done.stdout

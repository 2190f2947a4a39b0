"""Smoke runs of benches: bench/bench_gpu.py (`--allow-cpu`, CUDA hidden from it) prints its whole table;
bench/bench_hybrid_batching.py prints both arms and each row's exactness."""

from __future__ import annotations

import json
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


BULK_ARMS = ("generate", "actq", "actq torch's")


@pytest.mark.e2e  # the script starts Redis, the API and two workers
@pytest.mark.model  # and builds and loads the tiny model (SmolLM2's tokenizer: the smol_dir fixture)
def test_bench_bulk_smoke_run_prints_every_arm_beside_generate(smol_dir, tmp_path):
    """bench/bench_bulk.py on 6 jobs in batches of 3: each arm's tokens/s, its ratio to `generate`
    (1.00 for `generate` itself), and the profile of both worker arms; the JSON holds every run."""
    out = tmp_path / "bulk.json"
    done = subprocess.run(
        [sys.executable, "bench/bench_bulk.py", "--jobs", "6", "--batch", "3", "--max-tokens", "3", "--runs", "1"]
        + ["--torch-default", "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("arm ") and "x generate" in line)) + 1 :]
    rates = {}
    for line in table[: len(BULK_ARMS)]:
        name, rest = line[:14].strip(), line[14:].split()
        rates[name] = (float(rest[0]), float(rest[1]))
    assert list(rates) == list(BULK_ARMS), done.stdout
    assert rates["generate"][1] == 1.0 and all(rate > 0 and ratio > 0 for rate, ratio in rates.values()), rates
    for arm in BULK_ARMS[1:]:  # the ratio is of the rates before they were rounded to whole tokens/s
        (rate, ratio), base = rates[arm], rates["generate"][0]
        rounding = 0.005 + rate / base * (0.5 / rate + 0.5 / base)
        assert abs(ratio - rate / base) <= rounding, rates
    profile = lines[next(i for i, line in enumerate(lines) if line.startswith("arm ") and "submitted" in line) + 1 :]
    assert [line[:14].strip() for line in profile[: len(BULK_ARMS)]] == list(BULK_ARMS), done.stdout
    spent = lines[next(i for i, line in enumerate(lines) if line.startswith("CPU seconds per 1,000")) + 2 :]
    assert [line[:16].strip() for line in spent] == list(BULK_ARMS), done.stdout
    assert all(float(line[16:]) > 0 for line in spent), done.stdout
    recorded = json.loads(out.read_text())
    assert {arm: len(runs) for arm, runs in recorded["runs"].items()} == dict.fromkeys(BULK_ARMS, 1), recorded
    assert all(tokens == 6 * 3 for _, tokens in recorded["runs"]["generate"]), recorded["runs"]


@pytest.mark.model  # the script builds and loads tiny models (SmolLM2's tokenizer: the smol_dir fixture)
def test_bench_hybrid_batching_smoke_run_prints_both_arms_and_every_row_exact(smol_dir):
    """bench/bench_hybrid_batching.py on a tiny Mamba, 3 jobs of 4 tokens, once: a row of figures
    for both arms, and each row's exactness against its solo run (the script exits 1 otherwise)."""
    done = subprocess.run(
        [sys.executable, "bench/bench_hybrid_batching.py", "--models", "mamba", "--jobs", "3"]
        + ["--max-tokens", "4", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model"))
    assert "together tok/s" in lines[header] and "one at a time tok/s" in lines[header], lines[header]
    model, *figures = lines[header + 1].split()
    assert model == "mamba" and all(math.isfinite(float(f)) and float(f) > 0 for f in figures), lines[header + 1]
    exact = next(line for line in lines if line.startswith("mamba ") and "=" in line)
    assert exact.split()[1:][::2] == ["="] * 3, exact

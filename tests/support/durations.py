"""The order `make test` hands test files to its xdist processes: longest first.

xdist's loadfile sends each process whole files, the next one when it is nearly done; by default
the files with the most tests go first. A file of few long tests (the built-in model's, the
outages') then starts last and runs alone while the other processes idle: minutes of a CI run's
tail. With the files sorted by what each took in a measured run (tests/durations.json, seconds of
setup, run and teardown per file), the longest start first and the short ones fill in around them.
A file the record does not know counts as its folder's median.

Write the record from a run's JUnit report (make test-durations does it):

    .venv/bin/python -m tests.support.durations report.xml > tests/durations.json
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / "durations.json"


def load(record: Path = RECORD) -> dict[str, float]:
    """Seconds per test file (`tests/e2e/test_x.py`) as last measured; empty without a record."""
    try:
        return {str(k): float(v) for k, v in json.loads(record.read_text()).items()}
    except FileNotFoundError:
        return {}


def estimate(files: list[str], known: dict[str, float]) -> dict[str, float]:
    """Each of `files` its recorded seconds, or its folder's median (the whole record's for a
    folder it holds nothing of)."""
    by_folder: dict[str, list[float]] = defaultdict(list)
    for name, seconds in known.items():
        by_folder[name.rsplit("/", 1)[0]].append(seconds)
    overall = statistics.median(known.values()) if known else 0.0

    def guess(name: str) -> float:
        folder = by_folder.get(name.rsplit("/", 1)[0])
        return statistics.median(folder) if folder else overall

    return {name: known[name] if name in known else guess(name) for name in files}


def longest_first(files: list[str], known: dict[str, float]) -> list[str]:
    """`files` by estimated seconds, longest first; ties keep their order."""
    seconds = estimate(files, known)
    return sorted(files, key=lambda name: -seconds[name])


def from_junit(report: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report (pytest's xunit1 or xunit2: `classname` is the
    module's dotted path), rounded to a tenth."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()  # a test class's name
        if parts:
            totals["/".join(parts) + ".py"] += float(case.get("time") or 0)
    return {name: round(seconds, 1) for name, seconds in sorted(totals.items())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.durations JUNIT_REPORT > tests/durations.json")
    print(json.dumps(from_junit(Path(sys.argv[1])), indent=1, sort_keys=True))

"""make test hands out its files longest first (tests/support/durations.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import durations

ROOT = Path(__file__).resolve().parents[1]

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.e2e.test_a" name="test_one" time="10.5"/>
<testcase classname="tests.e2e.test_a" name="test_two[x]" time="2.0"/>
<testcase classname="tests.e2e.test_b.TestGroup" name="test_three" time="40.0"/>
<testcase classname="tests.test_c" name="test_four" time="0.25"><skipped/></testcase>
</testsuite></testsuites>
"""


def test_a_junit_report_gives_seconds_per_file_test_classes_folded_into_their_file(tmp_path: Path):
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    expected = {"tests/e2e/test_a.py": 12.5, "tests/e2e/test_b.py": 40.0, "tests/test_c.py": 0.2}
    assert durations.from_junit(report) == expected
    command = [sys.executable, "-m", "tests.support.durations", str(report)]
    written = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(written.stdout) == durations.from_junit(report)


def test_files_go_longest_first_and_an_unknown_file_counts_as_its_folders_median():
    known = {"tests/e2e/a.py": 100.0, "tests/e2e/b.py": 10.0, "tests/e2e/c.py": 30.0, "tests/w/d.py": 1.0}
    files = ["tests/w/d.py", "tests/e2e/b.py", "tests/e2e/new.py", "tests/e2e/a.py", "tests/x/new.py"]
    assert durations.estimate(files, known)["tests/e2e/new.py"] == 30.0  # the median of a, b and c
    assert durations.estimate(files, known)["tests/x/new.py"] == 20.0  # a folder of none: the median of all
    assert durations.longest_first(files, known) == [
        "tests/e2e/a.py",
        "tests/e2e/new.py",
        "tests/x/new.py",
        "tests/e2e/b.py",
        "tests/w/d.py",
    ]


def test_the_record_names_only_test_files_that_exist():
    record = durations.load()
    assert len(record) >= 100, "tests/durations.json: write it from a make test run's JUnit report"
    missing = [name for name in record if not (ROOT / name).is_file()]
    assert not missing, f"tests/durations.json names files that are gone (rewrite it): {missing}"

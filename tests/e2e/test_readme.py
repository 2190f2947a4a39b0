"""The README's examples run as written (tests/support/readme.py extracts them) against a live
`actq serve` with the built-in SmolLM2-135M-Instruct, the model the README's examples name, and
print what the README shows under them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.cli.processes import free_port
from tests.support import readme

README = Path(__file__).resolve().parents[2] / "README.md"
MODEL = "smollm2-135m"


def test_every_example_that_talks_to_a_stack_is_run():
    assert readme.unmarked_stack_examples(README) == [], "mark them <!-- run --> (tests/support/readme.py)"
    found = readme.examples(README)
    assert len(found) >= 10 and {e.lang for e in found} == {"sh", "python"}
    assert all(e.expected for e in found), [e.line for e in found if not e.expected]


@pytest.fixture
def serve(tmp_path, smol_dir):
    if shutil.which("jq") is None or shutil.which("curl") is None:
        pytest.skip("the README's shell examples use curl and jq")
    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTQ_")}
    env["ACTQ_MODEL_CACHE_DIR"] = str(smol_dir.parent)  # the converted model, as after `make run`
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # as after `source .venv/bin/activate`
    cmd = [sys.executable, "-m", "shared.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while f"actq is serving {MODEL} at {base}" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        assert httpx.get(f"{base}/health", timeout=5).json()["workers"][MODEL] > 0
        yield port, env
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(90)


def test_the_readme_examples_run_as_written(serve, tmp_path):
    port, env = serve
    work = tmp_path / "reader"
    work.mkdir()
    found = readme.examples(README)
    results = readme.run_all(found, port, work, env)
    problems = []
    for example, result in zip(found, results, strict=True):
        if not result["ok"]:
            problems.append(f"README line {example.line} failed:\n{example.code}\n{result['error'][-2000:]}")
        elif example.expected is not None and not readme.matches(example.expected, result["stdout"]):
            problems.append(
                f"README line {example.line} printed something else.\n--- README shows:\n{example.expected}"
                f"--- it printed:\n{result['stdout']}"
            )
    assert not problems, "\n\n".join(problems)

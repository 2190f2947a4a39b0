"""The manual's examples (README.md and every docs/ page, in mkdocs.yml's nav order) run as written
(tests/support/readme.py extracts them) against a live `actq serve` with the built-in
SmolLM2-135M-Instruct, the model the examples name, and print what the pages show under them."""

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

ROOT = Path(__file__).resolve().parents[2]
PAGES = readme.pages(ROOT)
MODEL = "smollm2-135m"


def _examples() -> list[readme.Example]:
    return [example for page in PAGES for example in readme.examples(page)]


def test_every_example_that_talks_to_a_stack_is_run():
    unmarked = {str(page.relative_to(ROOT)): readme.unmarked_stack_examples(page) for page in PAGES}
    assert not any(unmarked.values()), f"mark them <!-- run --> (tests/support/readme.py): {unmarked}"
    found = _examples()
    assert len(found) >= 10 and {e.lang for e in found} == {"sh", "python"}
    assert all(e.expected for e in found), [readme.where(e, ROOT) for e in found if not e.expected]
    assert readme.examples(ROOT / "README.md"), "the README keeps one example that runs"


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


@pytest.mark.slow  # every example of the manual on the built-in SmolLM2: 82 s on 2 quiet cores, 125 s in CI
def test_the_readme_examples_run_as_written(serve, tmp_path):
    port, env = serve
    work = tmp_path / "reader"
    work.mkdir()
    found = _examples()
    results = readme.run_all(found, port, work, env)
    slowest = sorted(zip(found, results, strict=True), key=lambda pair: -pair[1]["seconds"])[:8]
    spent = sum(r["seconds"] for r in results)
    shown = [f"{r['seconds']:6.1f} s {readme.where(e, ROOT)}" for e, r in slowest]
    print(f"{len(found)} examples: {spent:.1f} s; slowest:", *shown, sep="\n  ")  # pytest -s shows it
    problems = []
    for example, result in zip(found, results, strict=True):
        if not result["ok"]:
            problems.append(f"{readme.where(example, ROOT)} failed:\n{example.code}\n{result['error'][-2000:]}")
        elif example.expected is not None and not readme.matches(example.expected, result["stdout"]):
            problems.append(
                f"{readme.where(example, ROOT)} printed something else.\n--- the page shows:\n{example.expected}"
                f"--- it printed:\n{result['stdout']}"
            )
    assert not problems, "\n\n".join(problems)

"""What goes wrong reaching the API, or in what a command is given, is one line on stderr naming
what to change, exit 2, never a traceback, and nothing is left on disk (the `actq` command as a
user runs it, against a port nobody listens on or a real HTTP server refusing the key): one test runs
the command as a process of its own, the rest through the same entry point in this process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import pytest

from shared.cli import main


def actq(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`actq ARGS` through its console entry point (`shared.cli.main`: the one-line errors and exit
    code 2 are made there), run in this process with its stdout and stderr captured: a Python
    start per refusal was most of these tests' time. `actq_process` runs the command itself."""
    stdout, stderr = io.StringIO(), io.StringIO()
    environ = {"ACTQ_API_URL": "http://127.0.0.1:9", **(env or {})}
    code = 0
    with (
        mock.patch.dict(os.environ, environ),
        mock.patch.object(sys, "argv", ["actq", *args]),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                stderr.write(exit_.code + "\n")
    return subprocess.CompletedProcess(["actq", *args], code, stdout.getvalue(), stderr.getvalue())


def actq_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`actq ARGS` as a user runs it: a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ACTQ_API_URL": "http://127.0.0.1:9", **(env or {})},
    )


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "2 + 2 =", "topic": "math"}\n')
    return path


@pytest.fixture
def unreached_results(tmp_path):
    """A results directory whose one sample's activations were not downloaded."""
    results = tmp_path / "results"
    (results / "samples").mkdir(parents=True)
    tensor = {"name": "model.layers.1", "module": "model.layers.1", "hook": "output", "shape": [2, 8]}
    sample = {
        "index": 0,
        "id": 0,
        "labels": {"topic": "math"},
        "prompt": "x",
        "status": "succeeded",
        "job_id": "00000000-0000-4000-8000-000000000000",
        "activations": {"tensors": [{**tensor, "dtype": "float32", "positions": "all", "start": 0, "stop": 2}]},
        "activations_file": None,
    }
    (results / "samples" / "0.json").write_text(json.dumps(sample))
    return results


def test_an_unreachable_api_is_one_line_naming_the_url_and_how_to_change_it(
    tmp_path, closed_port, prompts, unreached_results
):
    url = f"http://127.0.0.1:{closed_port}"
    out = tmp_path / "run"
    for args in (
        ["run-file", str(prompts), "--out", str(out), "--api", url],
        ["gsm8k", "--dataset", "samples", "--limit", "2", "--out", str(out), "--api", url],
        ["export", str(unreached_results), "--out", str(out / "nested" / "x.parquet"), "--api", url],
        ["probe", str(unreached_results), "--label", "topic", "--api", url],
    ):
        line = one_line_error(actq_process(*args))
        assert url in line and "--api URL or ACTQ_API_URL" in line, line
        assert not out.exists(), args
    assert not (unreached_results / "export.parquet").exists() and not (unreached_results / "probes.json").exists()
    # ACTQ_API_URL is the default, and named as such
    line = one_line_error(actq("run-file", str(prompts), "--out", str(out), env={"ACTQ_API_URL": url}))
    assert f"cannot reach the actq API at {url}" in line and not out.exists()


class Refusing(BaseHTTPRequestHandler):
    """The API with keys on, as it answers a request without a valid one."""

    seen: list[str | None] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        body = json.dumps({"error": "unauthorized", "detail": "the API key is not valid"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_refused_key_is_one_line_naming_the_key_options(tmp_path, prompts, unreached_results):
    Refusing.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    out = tmp_path / "run"
    try:
        for args in (
            ["run-file", str(prompts), "--out", str(out), "--api", url, "--api-key", "wrong"],
            ["gsm8k", "--dataset", "samples", "--limit", "1", "--out", str(out), "--api", url],
            ["export", str(unreached_results), "--api", url, "--api-key", "wrong"],
            ["probe", str(unreached_results), "--label", "topic", "--api", url],
        ):
            line = one_line_error(actq(*args, env={"ACTQ_API_KEY": "from-env"}))
            assert url in line and "refused the API key" in line and "--api-key KEY or ACTQ_API_KEY" in line, line
            assert not out.exists()
    finally:
        server.shutdown()
        server.server_close()
    # --api-key wins over ACTQ_API_KEY, which is the default
    assert Refusing.seen == ["Bearer wrong", "Bearer from-env", "Bearer wrong", "Bearer from-env"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"prompt": "a"}\n{"prompt": "b", "temperature": 9}\n', "line 2: temperature"),
        ('{"prompt": "a"}\n{oops\n', "line 2: not JSON"),
        ('{"prompt": "a", "difficulty": NaN}\n', "line 1: label `difficulty`: NaN is not a finite number"),
        ('{"prompt": "a", "n": ' + "9" * 5000 + "}\n", "line 1: label `n`: an integer of 5000 digits is too long"),
    ],
)
def test_a_bad_prompt_file_is_one_line_and_leaves_no_out(tmp_path, closed_port, content, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    out = tmp_path / "run"
    line = one_line_error(actq("run-file", str(path), "--out", str(out), "--api", f"http://127.0.0.1:{closed_port}"))
    assert expected in line and not out.exists(), line


def test_bad_options_are_one_line(tmp_path, prompts):
    out = tmp_path / "run"
    assert "--mode 'score'" in one_line_error(actq("run-file", str(prompts), "--out", str(out), "--mode", "score"))
    assert "no such file" in one_line_error(actq("run-file", str(tmp_path / "absent.jsonl"), "--out", str(out)))
    assert "no such results directory" in one_line_error(actq("export", str(tmp_path / "absent")))
    assert not out.exists()

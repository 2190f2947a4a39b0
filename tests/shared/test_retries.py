"""The client waits out outages (shared/retries.py), over real HTTP: a real server on loopback
answers 503, 429 or 400 as the API does, stops and starts again; the Python client and the
`actq` command's one-line errors are checked against what it answered."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from shared.cli import remote
from shared.client import ActqClientError, BadRequest, Busy, Client, Unavailable

HEALTHY = (200, {}, {"status": "ok", "redis": "ok", "workers": {}})
REDIS_DOWN = (503, {}, {"error": "service_unavailable", "detail": "Redis (the job store) cannot be reached"})
STORAGE_DOWN = (
    503,
    {},
    {"error": "storage_error", "detail": "cannot read jobs/x: S3 endpoint http://127.0.0.1:1 is unreachable"},
)


class Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next of `script` (the last one once it runs out)."""

    script: list[tuple[int, dict, dict]] = []
    seen: list[float] = []

    def do_GET(self) -> None:
        self.seen.append(time.monotonic())
        status, headers, body = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


class Server:
    """The scripted server on a loopback port, which can be stopped and started on the same port."""

    def __init__(self, port: int = 0) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Scripted)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    Scripted.seen = []
    running = Server()
    yield running
    running.stop()


def test_503s_are_retried_with_growing_waits_and_each_retry_is_said(server):
    Scripted.script = [REDIS_DOWN, REDIS_DOWN, REDIS_DOWN, HEALTHY]
    said: list[str] = []
    with Client(server.url, on_retry=said.append) as client:
        assert client.health()["status"] == "ok"
    assert len(Scripted.seen) == 4 and len(said) == 3
    assert "503 service_unavailable: Redis (the job store) cannot be reached; retry 1 in" in said[0]
    waits = [b - a for a, b in zip(Scripted.seen, Scripted.seen[1:], strict=False)]
    assert waits[0] >= 0.5 and waits[2] >= 2.0, waits  # 0.5 s, 1 s, 2 s, each plus up to 1 s of jitter


def test_429_waits_what_retry_after_asks_and_a_bad_request_is_never_retried(server):
    Scripted.script = [(429, {"Retry-After": "2"}, {"error": "busy", "detail": "too many long polls"}), HEALTHY]
    with Client(server.url) as client:
        assert client.health()["status"] == "ok"
    assert Scripted.seen[1] - Scripted.seen[0] >= 1.9
    Scripted.seen = []
    Scripted.script = [(400, {}, {"error": "invalid_request", "detail": "max_tokens: too many"}), HEALTHY]
    with Client(server.url) as client, pytest.raises(BadRequest, match="max_tokens: too many"):
        client.health()
    assert len(Scripted.seen) == 1


def test_the_budget_bounds_the_retries_and_the_error_says_so(server):
    Scripted.script = [STORAGE_DOWN]
    started = time.monotonic()
    with Client(server.url, retry_seconds=3) as client, pytest.raises(Unavailable) as failed:
        client.health()
    assert time.monotonic() - started < 3.5 and len(Scripted.seen) >= 2
    line = remote.explain(failed.value, server.url)
    assert line is not None and "cannot reach" not in line
    assert f"the actq API at {server.url} answered that its storage is unavailable (503 storage_error: " in line
    assert "S3 endpoint http://127.0.0.1:1 is unreachable" in line
    assert "gave up after" in line and "the retry budget is 3 s (--retry-timeout)" in line
    # a Retry-After past the budget is not waited for at all
    Scripted.script = [(429, {"Retry-After": "120"}, {"error": "busy", "detail": "full"})]
    started = time.monotonic()
    with Client(server.url, retry_seconds=3) as client, pytest.raises(Busy) as busy:
        client.health()
    assert time.monotonic() - started < 1 and "the server asked to wait 120 s" in str(busy.value.__notes__)


def test_a_refused_connection_is_said_at_once_until_the_api_has_answered_then_waited_for(server):
    """Before any answer, a refused connection is a wrong URL: said at once, naming it. Once the
    API has answered, it is an outage: the server is stopped, and started again on the same port
    2 s later; the request succeeds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with Client(url) as client, pytest.raises(httpx.ConnectError) as refused:
        client.health()
    assert time.monotonic() - started < 2
    line = remote.explain(refused.value, url)
    assert line is not None and line.startswith(f"cannot reach the actq API at {url} (ConnectError")

    Scripted.script = [HEALTHY]
    said: list[str] = []
    with Client(server.url, on_retry=said.append) as client:
        client.health()
        server.stop()

        def restart() -> None:
            time.sleep(2)
            Server(server.port)

        threading.Thread(target=restart, daemon=True).start()
        assert client.health()["status"] == "ok"
    assert said and all("ConnectError" in line for line in said), said


def test_ctrl_c_ends_a_retry_wait(server):
    """A bulk run's Ctrl-C flag ends the wait between two attempts at once."""
    Scripted.script = [REDIS_DOWN]
    flag = threading.Event()
    threading.Timer(1.0, flag.set).start()
    started = time.monotonic()
    with Client(server.url, retry_seconds=60) as client:
        client.interrupted = flag
        with pytest.raises(KeyboardInterrupt):
            client.health()
    assert time.monotonic() - started < 5


def test_a_proxys_504_resends_only_what_can_be_sent_twice(server):
    """A 504 comes from a proxy: the API may have queued the job. A POST /jobs without an
    idempotency key is not sent again (it could make a second job); with one, it is."""
    gateway = (504, {}, {"error": "http_504", "detail": "gateway timeout"})
    queued = (202, {}, {"id": "00000000-0000-4000-8000-000000000001", "status": "queued"})
    Scripted.script = [gateway, queued]
    with Client(server.url) as client, pytest.raises(ActqClientError, match="gateway timeout"):
        client.submit("tiny", [{"role": "user", "content": "hi"}])
    assert len(Scripted.seen) == 1
    Scripted.seen, Scripted.script = [], [gateway, queued]
    with Client(server.url) as client:
        job = client.submit("tiny", [{"role": "user", "content": "hi"}], idempotency_key="k1")
    assert job.status == "queued" and len(Scripted.seen) == 2

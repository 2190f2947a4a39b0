"""Starting actq's processes on one machine (the worker and the API as child processes), waiting
until they serve, and stopping them so that nothing is left behind. Used by `actq run`, the tests
and the benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.redis_server import RedisServer, free_port
from shared.settings import Settings


def _spawn(cmd: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    handle = open(log, "ab")
    try:
        # A new session: stopping the group also stops the worker's pool child.
        return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        handle.close()


def start_worker(env: Mapping[str, str], log: Path, name: str = "actq") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "--loglevel=INFO", "-E",
           "-n", f"{name}-{os.getpid()}-{free_port()}@%h", "--without-mingle", "--without-gossip"]  # fmt: skip
    return _spawn(cmd, env, log)


def start_api(env: Mapping[str, str], log: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    return _spawn(cmd, env, log)


def stop(process: subprocess.Popen | None, timeout: float = 20.0) -> None:
    """SIGTERM the process group (Celery's warm shutdown), then SIGKILL whatever remains."""
    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def wait_ready(base_url: str, model: str, processes: list[subprocess.Popen], timeout: float, logs: list[Path]) -> None:
    """Until GET /health lists a live worker for `model`; fail fast when a process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process, log in zip(processes, logs):
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"{' '.join(process.args[:4])} exited with {process.returncode}:\n{tail}")
        try:
            health = httpx.get(f"{base_url}/health", timeout=2).json()
            if health.get("workers", {}).get(model, 0) > 0:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"no live worker for {model!r} after {timeout:.0f}s; see {', '.join(map(str, logs))}")


@dataclass
class LocalStack:
    base_url: str
    redis_url: str


@contextmanager
def local_stack(settings: Settings, start_timeout: float, say: Callable[[str], None] = print) -> Iterator[LocalStack]:
    """Redis (embedded unless ACTQ_REDIS_URL is set), a worker and the API on this machine;
    yields their addresses and stops all of them on the way out, whatever happens."""
    with ExitStack() as cleanup, tempfile.TemporaryDirectory(prefix="actq-run-") as tmp:
        env: dict[str, str] = {}
        if "redis_url" not in settings.model_fields_set:
            server = cleanup.enter_context(RedisServer(Path(tmp) / "redis"))
            env["ACTQ_REDIS_URL"] = server.url
            say(f"embedded Redis on {server.url}")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        logs = [Path(tmp) / "worker.log", Path(tmp) / "api.log"]
        worker = start_worker(env, logs[0])
        cleanup.callback(stop, worker)
        api = start_api(env, logs[1], port)
        cleanup.callback(stop, api)
        say(f"worker loading {settings.model} (the first run converts it once, ~30 s); API on {base}")
        wait_ready(base, settings.served_model_name, [worker, api], start_timeout, logs)
        yield LocalStack(base_url=base, redis_url=env.get("ACTQ_REDIS_URL", settings.redis_url))

"""actq's processes on one machine: workers and the API as child processes of this one, waiting
until they serve, and stopping all of them so that nothing is left behind. `actq run` uses it,
and so do the tests and the benchmarks: one way to start a stack."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.cli.processes import free_port, spawn, stop
from shared.cli.redis_server import RedisServer
from shared.registry import ModelRegistry
from shared.settings import Settings


def worker_command() -> list[str]:
    """A worker as docs/operations.md runs one. Without `-n` it names itself
    `actq-<model>-<6 hex>@<host>` (worker/celery_app.py), so workers on one machine are distinct
    nodes; mingle and gossip are off (worker/celery_app.py turns them off also when not asked)."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.celery_app",
        "worker",
        "-E",  # no --loglevel: Celery's default, WARNING, still logs one INFO line per job (tested)
        "--without-mingle",
        "--without-gossip",
    ]


def api_command(port: int, processes: int = 1, host: str = "127.0.0.1") -> list[str]:
    cmd = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", host, "--port", str(port)]
    cmd += ["--log-level", "warning"]
    return cmd + (["--workers", str(processes)] if processes > 1 else [])


def wait_http(base_url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 60) -> httpx.Response:
    """GET /health of an API that may still be starting (any answer counts: 503 is an answer)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(f"{base_url}/health", timeout=10)
        except httpx.TransportError:
            if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"the API at {base_url} did not come up") from None
            time.sleep(0.1)


def wait_ready(
    base_url: str,
    model: str,
    processes: list[subprocess.Popen[bytes]],
    timeout: float,
    logs: list[Path],
    started: Callable[[], bool] | None = None,
) -> None:
    """Until GET /health lists a live worker for `model` (and `started()` says the one just started
    is among them); fail fast when a process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process, log in zip(processes, logs, strict=True):
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"{' '.join(map(str, process.args[:4]))} exited with {process.returncode}:\n{tail}")  # type: ignore[index]
        try:
            health = httpx.get(f"{base_url}/health", timeout=2).json()
            if health.get("workers", {}).get(model, 0) > 0 and (started is None or started()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"no live worker for {model!r} after {timeout:.0f}s; see {', '.join(map(str, logs))}")


@dataclass
class Stack:
    """One deployment's processes on this machine, sharing `env` (ACTQ_* settings). The API is on
    `base_url`; workers are started by name; `stop()` (or leaving the `with`) stops them all."""

    root: Path
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)  # worker process name -> the model it serves
    host: str = "127.0.0.1"  # where the API listens
    console: bool = False  # the processes' output on this process's own, not in log files under `root`

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return self.env.get("ACTQ_REDIS_URL") or Settings().redis_url

    def _start(self, name: str, cmd: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.logs.setdefault(name, self.root / f"{name}.log")
        process = self.processes[name] = spawn(cmd, None if self.console else log, {**self.env, **env})
        return process

    def start_api(self, processes: int = 1, wait: bool = True) -> subprocess.Popen[bytes]:
        process = self._start("api", api_command(self.port, processes, self.host), {})
        if wait:
            wait_http(self.base_url, process)
        return process

    def start_worker(
        self, name: str, env: Mapping[str, str] | None = None, timeout: float = 300
    ) -> subprocess.Popen[bytes]:
        """A worker (`worker-<name>`) with `env` over the stack's; waits until the API lists it live
        (failing at once, with the log's tail, if it or the API dies meanwhile)."""
        env = dict(env or {})
        settings = {k.removeprefix("ACTQ_").lower(): v for k, v in {**self.env, **env}.items() if k.startswith("ACTQ_")}
        parsed = Settings.model_validate(settings)
        model = self.models[f"worker-{name}"] = parsed.served_model_name
        with redis.Redis.from_url(self.redis_url, socket_timeout=2) as client:
            registry = ModelRegistry(client, heartbeat_ttl=parsed.heartbeat_ttl)

            def live() -> set[str]:
                try:
                    return set(registry.live_workers(model))
                except redis.RedisError:
                    return set()

            before = live()  # read before the start: a Redis kept from a stopped stack lists its workers a while
            process = self._start(f"worker-{name}", worker_command(), env)
            names = [f"worker-{name}", *(["api"] if "api" in self.processes else [])]
            processes, logs = [self.processes[n] for n in names], [self.logs[n] for n in names]
            wait_ready(self.base_url, model, processes, timeout, logs, lambda: bool(live() - before))
        return process

    def stop_process(self, name: str) -> None:
        self.models.pop(name, None)
        stop(self.processes.pop(name, None))

    def stop(self) -> None:
        for name in list(self.processes):
            self.stop_process(name)

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace")[-chars:] if path and path.exists() else ""

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


@contextmanager
def local_stack(
    settings: Settings, start_timeout: float, say: Callable[[str], None] = print, temporary_store: bool = False
) -> Iterator[Stack]:
    """Redis (embedded unless ACTQ_REDIS_URL is set), a worker and the API on this machine; yields
    the stack and stops all of it on the way out, whatever happens. `temporary_store`: unless
    ACTQ_STORAGE_URL is set, the jobs' files go to a directory removed at the end (for a caller
    that downloads what it keeps)."""
    with ExitStack() as cleanup, tempfile.TemporaryDirectory(prefix="actq-run-") as tmp:
        env: dict[str, str] = {}
        if "redis_url" not in settings.model_fields_set:
            server = cleanup.enter_context(RedisServer(Path(tmp) / "redis"))
            env["ACTQ_REDIS_URL"] = server.url
            say(f"embedded Redis on {server.url}")
        if temporary_store and "storage_url" not in settings.model_fields_set:
            env["ACTQ_STORAGE_URL"] = (Path(tmp) / "store").as_uri()
        stack = cleanup.enter_context(Stack(Path(tmp), env))
        stack.start_api(wait=False)  # it starts while the worker loads its model
        say(f"worker loading {settings.model} (the first run converts it once, ~30 s); API on {stack.base_url}")
        stack.start_worker("actq", timeout=start_timeout)
        yield stack

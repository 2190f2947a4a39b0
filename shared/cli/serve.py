"""`actq serve`: a local stack that stays up. Its own Redis (data kept in the data directory), a
worker with the configured model and the API on 127.0.0.1:8000, in the foreground, their logs on
this terminal; Ctrl-C (or SIGTERM) stops all of it (the worker finishes or hands back what it runs, Redis
writes its append-only file), and the next `actq serve` on the same data directory finds every
finished job and its files again.

It never shares a Redis it did not start: ACTQ_REDIS_URL is ignored (with a line saying so)
unless `--redis-url` names that Redis. Activations go to `<data dir>/store` unless `--storage`
(or ACTQ_STORAGE_URL) says otherwise.

It watches its three processes: a Redis, worker or API that dies is started again (Redis on the
same port with the same data directory), with a line saying so, at most MAX_RESTARTS times in
RESTART_WINDOW seconds each; past that, or when a restart fails, everything stops at once with the
reason. Its Redis runs with `appendfsync always`: a job is answered 202 only once its record and
message are on disk, and a Redis that cannot write its append-only file (a full disk) exits
instead of acknowledging what it could not keep, so no accepted job depends on Redis staying up.
A store on the same filesystem as Redis's directory can fill it: serve warns at start.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from shared.cli.local_stack import Stack
from shared.cli.processes import stop
from shared.cli.redis_server import RedisServer
from shared.errors import ToolError
from shared.settings import Settings

DEFAULT_DATA_DIR = Path("actq-data")
MAX_RESTARTS = 3  # per process, within RESTART_WINDOW seconds
RESTART_WINDOW = 60.0


class Restarts:
    """How often each process was restarted lately; refuses once one dies too often."""

    def __init__(self, limit: int = MAX_RESTARTS, window: float = RESTART_WINDOW) -> None:
        self.limit, self.window = limit, window
        self.times: dict[str, deque[float]] = {}

    def allow(self, name: str) -> int | None:
        """The number of this restart within the window, or None when the limit is reached."""
        times = self.times.setdefault(name, deque())
        now = time.monotonic()
        while times and now - times[0] > self.window:
            times.popleft()
        if len(times) >= self.limit:
            return None
        times.append(now)
        return len(times)


def shared_filesystem_warning(redis_dir: Path, storage_url: str) -> str | None:
    """A warning when a local store shares the filesystem of Redis's append-only file."""
    if not storage_url.startswith("file:"):
        return None
    store = Path(url2pathname(urlparse(storage_url).path))
    existing = next((p for p in (store, *store.parents) if p.exists()), None)
    if existing is None or os.stat(existing).st_dev != os.stat(redis_dir).st_dev:
        return None
    return (
        f"warning: the activation store ({store}) and Redis's append-only file ({redis_dir}) share one "
        "filesystem: captures that fill it stop Redis from writing, and then actq serve stops (every job "
        "it accepted is kept); give the store a filesystem of its own with --storage file:///path/elsewhere"
    )


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _stop_like_ctrl_c(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def serve(
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    model: str | None = None,
    data_dir: Path = DEFAULT_DATA_DIR,
    storage: str | None = None,
    redis_url: str | None = None,
    start_timeout: float = 900.0,
    say: Callable[[str], None] = print,
    ready: Callable[[Stack], None] = lambda _: None,
) -> None:
    """Start everything, say where it is, and run until Ctrl-C (KeyboardInterrupt) or until a
    process dies (ToolError naming it); everything started is stopped on the way out."""
    settings = Settings()
    data_dir = data_dir.expanduser().resolve()
    signal.signal(signal.SIGTERM, _stop_like_ctrl_c)  # `kill`, a service manager: as Ctrl-C
    if _port_taken(host, port):
        raise ToolError(f"port {port} on {host} is taken (another actq serve?); pick another with --port")
    env: dict[str, str] = {}
    if model:
        env["ACTQ_MODEL"] = model
    env["ACTQ_STORAGE_URL"] = storage or (
        settings.storage_url if "storage_url" in settings.model_fields_set else (data_dir / "store").as_uri()
    )
    with ExitStack() as cleanup:
        if redis_url:
            env["ACTQ_REDIS_URL"] = redis_url
            say(f"Redis: {redis_url} (yours: left running at the end)")
        else:
            if "redis_url" in settings.model_fields_set:
                say(
                    f"ignoring ACTQ_REDIS_URL={settings.redis_url}: actq serve starts a Redis of its own; "
                    "pass --redis-url to use that one instead"
                )
            server = cleanup.enter_context(RedisServer(data_dir / "redis", appendfsync="always"))
            env["ACTQ_REDIS_URL"] = server.url
            say(f"Redis: {server.url}, data in {data_dir / 'redis'}")
            warning = shared_filesystem_warning(server.directory, env["ACTQ_STORAGE_URL"])
            if warning:
                say(warning)
        stack = cleanup.enter_context(Stack(data_dir / "logs", env, port=port, host=host, console=True))
        stack.start_api(wait=False)  # it starts while the worker loads its model
        served = (Settings(model=model) if model else settings).served_model_name
        say(f"worker loading {model or settings.model} (the first start converts the built-in model, ~30 s)")
        stack.start_worker("serve", timeout=start_timeout)
        say(
            f"actq is serving {served} at http://{host}:{port} (API docs: /docs); activations in "
            f"{env['ACTQ_STORAGE_URL']}; Ctrl-C stops everything"
        )
        ready(stack)
        watch(stack, None if redis_url else server, start_timeout, say)


def watch(
    stack: Stack,
    server: RedisServer | None,
    start_timeout: float,
    say: Callable[[str], None],
    restarts: Restarts | None = None,
) -> None:
    """Until a process dies too often (ToolError with the reason): restart whichever died."""
    restarts = restarts or Restarts()
    while True:
        if server is not None and server.process is not None and server.process.poll() is not None:
            code, why = server.process.returncode, server.log_tail()
            _restart_or_stop(restarts, "Redis", code, why, say)
            try:
                server.start()
            except RuntimeError as exc:
                raise ToolError(
                    f"Redis could not be restarted ({exc}: {server.log_tail()}); stopping the rest"
                ) from None
        for name, process in list(stack.processes.items()):
            if process.poll() is None:
                continue
            _restart_or_stop(restarts, name, process.returncode, "", say)
            stop(process, timeout=1)  # whatever is left of its process group (a worker's engine process)
            try:
                if name == "api":
                    stack.start_api(wait=False)
                else:
                    stack.start_worker(name.removeprefix("worker-"), timeout=start_timeout)
            except (RuntimeError, TimeoutError) as exc:
                raise ToolError(f"{name} could not be started again ({exc}); stopping the rest") from None
            say(f"{name} is back")
        time.sleep(0.5)


def _restart_or_stop(restarts: Restarts, name: str, code: int | None, why: str, say: Callable[[str], None]) -> None:
    detail = f"exited with code {code}" + (f" ({why})" if why else "")
    count = restarts.allow(name)
    if count is None:
        raise ToolError(
            f"{name} {detail}, its {restarts.limit + 1}th exit within {restarts.window:.0f} s; stopping the rest"
        )
    say(f"{name} {detail}; starting it again ({count} of {restarts.limit} restarts allowed in {restarts.window:.0f} s)")

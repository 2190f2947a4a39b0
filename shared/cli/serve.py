"""`actq serve`: a local stack that stays up. Its own Redis (data kept in the data directory), a
worker with the configured model and the API on 127.0.0.1:8000, in the foreground, their logs on
this terminal; Ctrl-C (or SIGTERM) stops all of it (the worker finishes or hands back what it runs, Redis
writes its append-only file), and the next `actq serve` on the same data directory finds every
finished job and its files again.

It never shares a Redis it did not start: ACTQ_REDIS_URL is ignored (with a line saying so)
unless `--redis-url` names that Redis. Activations go to `<data dir>/store` unless `--storage`
(or ACTQ_STORAGE_URL) says otherwise.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from shared.cli.local_stack import Stack
from shared.cli.redis_server import RedisServer
from shared.errors import ToolError
from shared.settings import Settings

DEFAULT_DATA_DIR = Path("actq-data")


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
            server = cleanup.enter_context(RedisServer(data_dir / "redis"))
            env["ACTQ_REDIS_URL"] = server.url
            say(f"Redis: {server.url}, data in {data_dir / 'redis'}")
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
        while True:
            for name, process in stack.processes.items():
                if process.poll() is not None:
                    raise ToolError(f"{name} exited with code {process.returncode}; stopping the rest")
            time.sleep(0.5)

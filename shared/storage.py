"""Artifact stores. One URL setting picks the implementation; keys are built by actq, never by a request.

Layout: `jobs/<job_id>/activations.safetensors` and `jobs/<job_id>/manifest.json`.
"""

from __future__ import annotations

import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from shared.errors import StorageError
from shared.settings import Settings

_KEY = re.compile(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_.-]+)*")


def activations_key(job_id: str) -> str:
    return f"jobs/{job_id}/activations.safetensors"


def job_prefix(job_id: str) -> str:
    return f"jobs/{job_id}"


def manifest_key(job_id: str) -> str:
    return f"jobs/{job_id}/manifest.json"


def check_key(key: str) -> str:
    """Keys are relative, slash-separated, with no empty, '.' or '..' parts."""
    if not _KEY.fullmatch(key) or any(part in (".", "..") or part.startswith(".") for part in key.split("/")):
        raise ValueError(f"invalid storage key {key!r}")
    return key


class ArtifactStore(ABC):
    # Whether files written to scratch_dir() must be fsynced: yes when they become the stored
    # object (local rename); no when they are only uploaded and deleted (S3 keeps them durable).
    durable_scratch = True

    @abstractmethod
    def put_file(self, key: str, src: Path) -> str:
        """Store a finished local file under `key` (consuming it); returns the object's URI.
        The object appears whole or not at all."""

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
    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start`: a seek on disk, an HTTP Range request on S3."""

    @abstractmethod
    def stream(self, key: str, chunk: int = 1 << 20) -> Iterator[bytes]: ...

    @abstractmethod
    def presigned_url(self, key: str, expires: int) -> str | None:
        """A URL a client can download from directly, or None (local store: the API streams)."""

    @abstractmethod
    def check(self) -> None:
        """Raise StorageError when the store cannot be used (for /health)."""


class LocalStore(ArtifactStore):
    """A directory. Writes are atomic: temp file in the same filesystem, fsync, rename, fsync dir."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.bytes_read = 0  # bytes returned by read_range (tests check partial reads)

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"invalid storage key {key!r}")
        return path

    def scratch_dir(self) -> Path:
        scratch = self.root / ".tmp"
        try:
            scratch.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create {scratch}: {exc.strerror}") from exc
        return scratch

    def put_file(self, key: str, src: Path) -> str:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(src, dest)
            _fsync_dir(dest.parent)
        except OSError as exc:
            raise StorageError(f"cannot store {key} in {self.root}: {exc.strerror or exc}") from exc
        return dest.as_uri()

    def put_bytes(self, key: str, data: bytes) -> str:
        fd, tmp = tempfile.mkstemp(dir=self.scratch_dir())
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise StorageError(f"cannot write {key}: {exc.strerror or exc}") from exc
        return self.put_file(key, Path(tmp))

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def delete_prefix(self, prefix: str) -> None:
        base = self._path(prefix)
        if base.is_dir():
            for child in sorted(base.rglob("*"), reverse=True):
                child.rmdir() if child.is_dir() else child.unlink()
            base.rmdir()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as handle:
                handle.seek(start)
                data = handle.read(length)
        except OSError as exc:
            raise StorageError(f"cannot read {key}: {exc.strerror}") from exc
        self.bytes_read += len(data)
        return data

    def stream(self, key: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        with open(self._path(key), "rb") as handle:
            while data := handle.read(chunk):
                yield data

    def presigned_url(self, key: str, expires: int) -> str | None:
        return None

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StorageError(f"{self.root} is not a directory")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_store(settings: Settings, wait_for_outages: bool = False) -> ArtifactStore:
    """The store ACTQ_STORAGE_URL names: `file:///abs/dir` or `s3://bucket/prefix`. The worker's
    store waits out an unreachable S3 endpoint for ACTQ_STORAGE_OUTAGE_SECONDS; the API's does not."""
    url = settings.storage_url
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"ACTQ_STORAGE_URL {url!r}: file URLs must be local (file:///abs/dir)")
        return LocalStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"ACTQ_STORAGE_URL {url!r}: name a bucket (s3://bucket/prefix)")
        from shared.s3_store import S3Store

        return S3Store(
            parsed.netloc,
            parsed.path,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            chunk_bytes=settings.s3_multipart_chunk_bytes,
            outage_seconds=settings.storage_outage_seconds if wait_for_outages else 0,
        )
    raise ValueError(f"ACTQ_STORAGE_URL {url!r}: unsupported scheme {parsed.scheme!r} (use file:///abs/dir or s3://bucket/prefix)")

"""The local-directory artifact store. Writes are atomic: a temp file in the same filesystem,
fsync, rename, fsync of the directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from shared.errors import StorageError
from shared.storage.base import ArtifactStore, check_key


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

    def put_file(self, key: str, src: Path, *, sync_folder: bool = True) -> str:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(src, dest)
            if sync_folder:
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

    def folders(self, prefix: str) -> list[str]:
        try:
            return sorted(f"{prefix}/{child.name}" for child in self._path(prefix).iterdir() if child.is_dir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {prefix}: {exc.strerror or exc}") from exc

    def read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as handle:
                handle.seek(start)
                data = handle.read(length)
        except OSError as exc:
            raise StorageError(f"cannot read {key}: {exc.strerror}") from exc
        self.bytes_read += len(data)
        return data

    def stream_range(self, key: str, start: int, length: int, chunk: int = 1 << 20) -> Iterator[bytes]:
        try:
            handle = open(self._path(key), "rb")  # closed by the `with` below, when the generator ends
        except OSError as exc:
            raise StorageError(f"cannot read {key}: {exc.strerror}") from exc
        with handle:
            handle.seek(start)
            left = length
            while left > 0:
                data = handle.read(min(chunk, left))
                if not data:
                    raise StorageError(f"{key} ends {left} bytes early")
                self.bytes_read += len(data)
                left -= len(data)
                yield data

    def stream(self, key: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        try:
            handle = open(self._path(key), "rb")  # closed by the `with` below, when the generator ends
        except OSError as exc:  # the key, never the server's path (it reaches the job's error)
            raise StorageError(f"cannot read {key}: {exc.strerror}") from exc
        with handle:
            while data := handle.read(chunk):
                yield data

    def presigned_url(self, key: str, expires: int) -> str | None:
        return None

    def check(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StorageError(f"{self.root} is not a directory")

    def free_bytes(self) -> int | None:
        """Free bytes of the filesystem holding the root (or, before its first file, its nearest
        existing parent: where the root will be made)."""
        path = self.root
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""A client Job's files: the whole activations file (as bytes, as tensors, or streamed to disk),
one tensor or some of its rows, each checked against the manifest's sha256. torch and
safetensors are imported only by the methods that return tensors."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import httpx

from shared.client_errors import ChecksumMismatch

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from shared.client import Client
    from shared.client_jobs import Job


class JobDownloads:
    """The downloads of a Job (shared/client_jobs.py), which it inherits."""

    _client: Client
    data: dict

    if TYPE_CHECKING:  # pragma: no cover - Job's own, in shared/client_jobs.py

        @property
        def id(self) -> str: ...

        @property
        def manifest(self) -> dict | None: ...

        def refresh(self, wait: float = 0.0) -> Job: ...

    @contextmanager
    def _stream_file(self, *, proxy: bool = False, retried: bool = True) -> Iterator[httpx.Response]:
        params = {"proxy": "true"} if proxy else None
        with self._client._stream("GET", f"/jobs/{self.id}/activations", retried, params=params) as response:
            yield response

    def _expected(self) -> dict | None:
        if self.manifest is None:
            self.refresh()
        return self.manifest

    def _check(self, digest: str, size: int) -> None:
        manifest = self._expected()
        if manifest is None:
            return
        if size != manifest["bytes"] or digest != manifest["sha256"]:
            raise ChecksumMismatch(
                None,
                "checksum_mismatch",
                f"activations of job {self.id}: got {size} bytes with sha256 {digest}, the manifest says "
                f"{manifest['bytes']} bytes with sha256 {manifest['sha256']}",
            )

    def activations_bytes(self, *, proxy: bool = False) -> bytes:
        """The job's safetensors file as bytes, checked against the manifest's sha256 and size.
        `proxy=True` asks the API to stream it instead of redirecting to the object store."""
        with self._stream_file(proxy=proxy) as response:
            data = response.read()
        self._check(hashlib.sha256(data).hexdigest(), len(data))
        return data

    def activations(self, *, proxy: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor of the job's file, `{name: tensor}`, after checking the download's sha256
        against the manifest: the captures in the manifest's order, then `token_ids` and any
        others (log-probabilities) by name. Needs torch and safetensors."""
        from safetensors.torch import load

        tensors = load(self.activations_bytes(proxy=proxy))
        listed = [t["name"] for t in (self.data.get("activations") or {}).get("tensors", []) if t["name"] in tensors]
        order = listed + sorted(set(tensors) - set(listed))
        return {name: tensors[name] for name in order}

    def download(self, path: str | os.PathLike, *, proxy: bool = False) -> Path:
        """Stream the safetensors file to `path` (written to a temporary file beside it, checked
        against the manifest's sha256, then renamed). Returns the path. A connection lost in the
        middle starts the download again, within the client's retry budget."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for attempt in self._client._retrying("GET"):
            with attempt:
                self._download_once(path, proxy)
        return path

    def _download_once(self, path: Path, proxy: bool) -> None:
        digest, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, self._stream_file(proxy=proxy, retried=False) as response:
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            self._check(digest.hexdigest(), size)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def tensor(self, name: str, rows: slice | tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor of the job's file, fetched alone (`GET /jobs/{id}/activations/{name}`).
        `rows` selects rows of the first dimension: a `slice` (step 1) or a `(start, stop)` pair;
        with a slice, negative or missing bounds are resolved from the manifest's shape."""
        from safetensors.torch import load

        params = None
        if rows is not None:
            params = {"rows": self._rows(name, rows)}
        with self._client._stream(
            "GET", f"/jobs/{self.id}/activations/{quote(name, safe='')}", params=params
        ) as response:
            data = response.read()
            expected = response.headers.get("x-actq-tensor-sha256") if rows is None else None
        if expected is not None:  # the tensor's bytes follow the small file's header
            start = 8 + int.from_bytes(data[:8], "little")
            got = hashlib.sha256(memoryview(data)[start:]).hexdigest()
            if got != expected:
                raise ChecksumMismatch(
                    None,
                    "checksum_mismatch",
                    f"tensor {name} of job {self.id}: sha256 {got}, the manifest says {expected}",
                )
        return load(data)[name]

    def _rows(self, name: str, rows: slice | tuple[int, int]) -> str:
        if isinstance(rows, tuple):
            start, stop = rows
            return f"{int(start)}:{int(stop)}"
        if rows.step not in (None, 1):
            raise ValueError("rows: only contiguous slices (step 1) can be fetched")
        info = next((t for t in (self.manifest or {}).get("tensors", []) if t["name"] == name), None)
        if info is not None:
            start, stop, _ = rows.indices(info["shape"][0])
            return f"{start}:{max(start, stop)}"
        if (rows.start or 0) < 0 or (rows.stop or 0) < 0:
            raise ValueError(f"rows: negative bounds need the tensor's length, and {name!r} is not in the manifest")
        return f"{rows.start or 0}:{'' if rows.stop is None else rows.stop}"

"""Where an export's data comes from (`actq export`, export.py): each source's tensors from its
downloaded file, else through the API one tensor at a time (one client for the whole export,
retried through outages for up to --retry-timeout); the next sample of a --jobs export, whose
reading fetches its job. A fetch that fails for good is a `FetchFailed` naming what failed
(shared/cli/remote.py), on which the export keeps what it has (export_partial.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shared.cli.export_partial import FetchFailed
from shared.errors import ToolError

TOKEN_IDS = "token_ids"


class Reader:
    """Tensors of one source as numpy arrays, float32 (or, with `native`, float16 and float32 as
    stored, bfloat16 widened exactly to float32): from its downloaded file, else through the API
    (one client for the whole export, opened at the first tensor that needs it)."""

    def __init__(
        self,
        results: Path | None,
        api: str | None,
        api_key: str | None = None,
        client: Any = None,
        url: str = "",
        retry_seconds: float | None = None,
    ) -> None:
        self.results = results
        self.api = api
        self.api_key = api_key
        self._client: Any = client
        self.url = url
        self.retry_seconds = retry_seconds

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def read(
        self, sample: dict, source: str, fields: dict, names: list[str], native: bool = False
    ) -> dict[str, np.ndarray]:
        file = fields.get("activations_file")
        if file and self.results is not None and (self.results / file).is_file():
            return self._read_file(self.results / file, names, native)
        return self._fetch(sample, source, fields, names, native)

    def _read_file(self, path: Path, names: list[str], native: bool = False) -> dict[str, np.ndarray]:
        from safetensors import safe_open

        out: dict[str, np.ndarray] = {}
        bf16: list[str] = []
        with safe_open(str(path), framework="np") as f:
            present = set(f.keys())
            if TOKEN_IDS in present:
                out[TOKEN_IDS] = np.asarray(f.get_tensor(TOKEN_IDS), dtype=np.int64)
            for name in names:
                if name not in present:
                    raise ToolError(f"{path}: no tensor {name!r}, which its manifest lists")
                if f.get_slice(name).get_dtype() == "BF16":
                    bf16.append(name)  # numpy has no bfloat16: read through torch below
                else:
                    tensor = np.asarray(f.get_tensor(name))
                    out[name] = (
                        tensor if native and tensor.dtype == np.float16 else tensor.astype(np.float32, copy=False)
                    )
        if bf16:
            with safe_open(str(path), framework="pt") as f:
                for name in bf16:
                    out[name] = f.get_tensor(name).float().numpy()
        return out

    def _fetch(
        self, sample: dict, source: str, fields: dict, names: list[str], native: bool = False
    ) -> dict[str, np.ndarray]:
        import httpx

        from shared.cli import remote
        from shared.client import ActqClientError, NotFound

        job_id = fields.get("job_id")
        where = f"sample {sample.get('index')} ({source})"
        fix = "run the command with --download, or give --api (and --api-key) for the API that ran it"
        if not job_id:
            raise ToolError(f"{where}: its activations are not in {self.results} and it has no job id; {fix}")
        try:
            if self._client is None:
                self.url, key = remote.resolve(self.api, self.api_key)
                seconds = remote.DEFAULT_SECONDS if self.retry_seconds is None else self.retry_seconds
                self._client = remote.client(self.url, key, retry_seconds=seconds)
            job = self._client.job(job_id)
            tensors = {name: _as_array(job.tensor(name), native) for name in names}
            try:
                tensors[TOKEN_IDS] = job.tensor(TOKEN_IDS).numpy().astype(np.int64)
            except NotFound:  # a file written without them
                pass
            return tensors
        except (httpx.HTTPError, ActqClientError) as exc:
            if self.results is None:  # --jobs: the API is the only place they are
                raise FetchFailed(
                    f"job {job_id}: fetching its activations failed: {remote.explain(exc, self.url)}"
                ) from None
            raise FetchFailed(
                f"{where}: its activations are not in {self.results} ({fix}), and fetching them failed: "
                f"{remote.explain(exc, self.url)}"
            ) from None


def _as_array(tensor: Any, native: bool) -> np.ndarray:
    """A fetched torch tensor as numpy: float32, or float16 kept as it is when `native`."""
    import torch

    return tensor.numpy() if native and tensor.dtype == torch.float16 else tensor.float().numpy()


def next_sample(samples: Iterator[dict], reader: Reader) -> dict | None:
    """The next sample (None at the end); reading a --jobs sample fetches its job and request."""
    import httpx

    from shared.cli import remote
    from shared.client import ActqClientError

    try:
        return next(samples)
    except StopIteration:
        return None
    except (httpx.HTTPError, ActqClientError) as exc:
        raise FetchFailed(f"reading a job to export failed: {remote.explain(exc, reader.url)}") from None

"""`Client.nnsight`: an nnsight backend that sends a trace through actq's plain HTTP routes, for
networks where nnsight's own client cannot open its WebSocket. The payload is the one nnsight
builds (`RequestModel.serialize`), sent to `POST /request` with the client's key; the job is
waited for with actq's long polls and its saves downloaded from `GET /jobs/{id}/nnsight-result`.

The saves are loaded with `torch.load(weights_only=False)`, as nnsight's own client loads them:
only point this at an actq you trust, as you trust it to run your code (docs/nnsight.md).
Imported only when called: nnsight patches torch when it is imported.
"""

from __future__ import annotations

import io
import sys
from importlib.metadata import version
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from shared.client import Client


def backend(client: Client, model: Any, compress: bool = True, timeout: float | None = None) -> Any:
    """An nnsight Backend for `model` (nnsight's TransformersModel or LanguageModel) that runs each
    trace it is given as an actq nnsight job; `.saves` holds the last trace's saved values, which
    are also set in the trace's frame as a local run sets them."""
    from nnsight.ndif import pull_env
    from nnsight.schema.request import RequestModel
    from nnsight.tracing.backend import Backend
    from nnsight.tracing.tracer import save
    from nnsight.tracing.util import push

    class ActqBackend(Backend):
        def __init__(self) -> None:
            self.saves: dict[str, Any] = {}
            self.job_id: str | None = None

        def __call__(self, tracer: Any = None) -> dict[str, Any]:
            pull_env()  # the trace's local modules travel by value, as with nnsight's own client
            blob = RequestModel.serialize(tracer, compress)
            envelope = RequestModel(model_key=model.to_model_key(), compress=compress, env=model._remoteable_get_env())
            headers = {"nnsight-version": version("nnsight"), "python-version": sys.version}
            sent = client._request(
                "POST",
                "/request",
                data={"data": envelope.metadata()},
                files={"blob": ("request", blob, "application/octet-stream")},
                headers=headers,
            ).json()
            self.job_id = sent["id"]
            job = client.job(sent["id"]).wait(timeout)
            data = client._request("GET", f"/jobs/{quote(job.id, safe='')}/nnsight-result").content
            self.saves = load_saves(data, compress)
            for value in self.saves.values():
                save(value)
            if tracer is not None and tracer.info is not None and tracer.info.frame is not None:
                push(tracer.info.frame, self.saves)
            return self.saves

    return ActqBackend()


def load_saves(data: bytes, compress: bool) -> dict[str, Any]:
    """An nnsight job's result as its client reads it (zstd, then torch.save's format)."""
    import torch

    if compress:
        import zstandard

        data = zstandard.ZstdDecompressor().decompress(data)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)

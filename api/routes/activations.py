"""Downloads: a job's whole safetensors file, or one tensor of it (GET, and HEAD for the headers)."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from api.deps import CallerDep, Services, ServicesDep, get_caller
from api.visibility import load
from shared.errors import JobNotFound, NotReady, TensorNotFound
from shared.schemas import ActivationsManifest, JobStatus
from shared.storage.tensors import parse_rows, read_tensor

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(get_caller)])
ERRORS: dict[int | str, dict[str, object]] = {404: {"description": "No such job"}, 409: {"description": "Not ready"}}


def _manifest(services: Services, job_id: str, caller: str | None) -> ActivationsManifest:
    record = load(services, job_id, caller)
    if record.status is not JobStatus.succeeded:
        raise NotReady(f"job {job_id} is {record.status.value}; activations exist once it has succeeded")
    if record.activations is None:
        raise JobNotFound(
            f"job {job_id} captured no activations (its request had no capture spec, and its log-probabilities, "
            "if any, are in its result)"
        )
    return record.activations


@router.get("/{job_id}/activations", responses={**ERRORS, 307: {"description": "S3: presigned URL"}})
@router.head("/{job_id}/activations", responses=ERRORS)
def download_activations(
    job_id: str, request: Request, services: ServicesDep, caller: CallerDep, proxy: bool = False
) -> Response:
    """The job's safetensors file: streamed (local store, or S3 with proxy=true; HTTP Range
    supported on the local store), or a 307 redirect to a presigned S3 URL. HEAD answers the
    headers alone (Content-Length, ETag: the file's sha256), from any store."""
    manifest = _manifest(services, job_id, caller)
    headers = {"etag": f'"{manifest.sha256}"', "content-disposition": f'attachment; filename="{job_id}.safetensors"'}
    path = services.store.local_path(manifest.key)
    if path is not None and not path.is_file():
        raise JobNotFound(f"the activations of job {job_id} are no longer in the store")
    if request.method == "HEAD":
        headers["content-length"] = str(manifest.bytes)
        return Response(media_type="application/octet-stream", headers=headers)
    if path is not None:
        return FileResponse(path, media_type="application/octet-stream", headers=headers)
    if not proxy:
        url = services.store.presigned_url(manifest.key, services.settings.presign_expiry_seconds)
        return RedirectResponse(str(url), status_code=307)
    headers["content-length"] = str(manifest.bytes)
    return StreamingResponse(
        services.store.stream(manifest.key), media_type="application/octet-stream", headers=headers
    )


@router.get("/{job_id}/activations/{name}", responses=ERRORS)
@router.head("/{job_id}/activations/{name}", responses=ERRORS)
def download_tensor(
    job_id: str,
    name: str,
    request: Request,
    services: ServicesDep,
    caller: CallerDep,
    rows: Annotated[str | None, Query(description="start:stop, a slice of the first dimension", max_length=40)] = None,
) -> Response:
    """One tensor as a small safetensors file, read through the header's byte offsets."""
    manifest = _manifest(services, job_id, caller)
    known = {t.name for t in manifest.tensors} | {"token_ids"} | set(manifest.extra)
    if name not in known:
        raise TensorNotFound(f"no tensor named {name!r} in job {job_id}; tensors: {', '.join(sorted(known))}")
    data = read_tensor(services.store, manifest.key, name, parse_rows(rows))
    headers = {"etag": f'"{hashlib.sha256(data).hexdigest()}"', "content-length": str(len(data))}
    return Response(b"" if request.method == "HEAD" else data, media_type="application/octet-stream", headers=headers)

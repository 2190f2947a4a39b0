"""Downloads: a job's whole safetensors file, or one tensor of it (GET, and HEAD for the headers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse

from api.deps import CallerDep, Services, ServicesDep, get_caller
from api.visibility import load
from shared.errors import JobNotFound, NotReady, TensorNotFound
from shared.schemas import ActivationsManifest, JobStatus
from shared.storage.tensors import TensorSlice, parse_rows, tensor_slice

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[Depends(get_caller)])
ERRORS: dict[int | str, dict[str, object]] = {404: {"description": "No such job"}, 409: {"description": "Not ready"}}
TENSOR_CHUNK = 256 << 10  # bytes of a tensor held at once while it is streamed


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
    """One tensor as a small safetensors file: the stored file's header is read, then the tensor's
    byte range is streamed in chunks (a seek on disk, one Range request on S3); HEAD reads the
    header only. The ETag is the tensor's sha256 from the manifest (with rows, plus the rows), so
    neither reads the tensor to answer; `X-Actq-Tensor-Sha256` is that sha256 of the whole tensor."""
    manifest = _manifest(services, job_id, caller)
    known = {t.name for t in manifest.tensors} | {"token_ids"} | set(manifest.extra)
    if name not in known:
        raise TensorNotFound(f"no tensor named {name!r} in job {job_id}; tensors: {', '.join(sorted(known))}")
    part = tensor_slice(services.store, manifest.key, name, parse_rows(rows))
    headers = {"content-length": str(part.size)}
    digest = manifest.tensor_sha256(name)
    if digest is None:  # a file written before manifests held each tensor's sha256
        digest = f"{manifest.sha256}-{name}"
    else:
        headers["x-actq-tensor-sha256"] = digest
    headers["etag"] = f'"{digest}"' if part.rows is None else f'"{digest}-{part.rows[0]}-{part.rows[1]}"'
    if request.method == "HEAD":
        return Response(media_type="application/octet-stream", headers=headers)
    return StreamingResponse(
        _tensor_bytes(services, manifest.key, part), media_type="application/octet-stream", headers=headers
    )


def _tensor_bytes(services: Services, key: str, part: TensorSlice) -> Iterator[bytes]:
    yield part.head
    yield from services.store.stream_range(key, part.offset, part.length, TENSOR_CHUNK)

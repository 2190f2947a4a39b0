"""Vector sets: upload a safetensors file of steering vectors, list, read, download and delete.

A set belongs to the API key that uploaded it: another key gets 404 for it on every route, as for
jobs. Ids are checked as uuid4s before any Redis key or storage key is built from them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse

from api.deps import CallerDep, Services, ServicesDep, get_caller
from shared.errors import PayloadTooLarge, VectorSetNotFound
from shared.vectors import MAX_LABEL_CHARS, VectorSet, VectorSets, new_vector_set, vector_prefix

router = APIRouter(prefix="/vectors", tags=["vectors"], dependencies=[Depends(get_caller)])
ERRORS: dict[int | str, dict[str, object]] = {404: {"description": "No such vector set"}}
UPLOAD_BODY = {
    "required": True,
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}


def _sets(services: Services) -> VectorSets:
    return VectorSets(services.redis, services.store, services.settings.max_vector_sets_per_key)


def _keys_on(services: Services) -> bool:
    """With API keys off everything is open (as for jobs): a set is found whoever uploaded it."""
    return bool(services.settings.api_key_list)


async def _body(request: Request, limit: int) -> bytes:
    """The whole body, never holding more than `limit` + 1 bytes: a declared Content-Length over
    the limit is refused before reading, and a body without one (chunked) or a lying one is
    refused as soon as its bytes pass the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large(limit)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk[: limit + 1 - len(data)]
        if len(data) > limit:
            raise too_large(limit)
    return bytes(data)


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"a vector set file is at most {limit:,} bytes (ACTQ_VECTOR_MAX_BYTES); send fewer tensors")


def _upload(services: Services, data: bytes, owner: str | None, label: str | None) -> VectorSet:
    """Check, store, record (off the event loop: numpy over the whole file, and S3 is remote).
    The count limit is checked before the file is stored and again, atomically, as it is recorded;
    a set that is not recorded leaves no file behind."""
    record = new_vector_set(data, owner, label)
    sets = _sets(services)
    sets.check_room(owner)
    services.store.put_bytes(record.key, data)
    try:
        sets.create(record)
    except Exception:
        services.store.delete_prefix(vector_prefix(record.id))
        raise
    return record


@router.post(
    "",
    status_code=201,
    response_model=VectorSet,
    responses={413: {"description": "Over ACTQ_VECTOR_MAX_BYTES"}, 422: {}, 429: {}},
    openapi_extra={"requestBody": UPLOAD_BODY},
)
async def upload_vectors(
    request: Request,
    response: Response,
    services: ServicesDep,
    caller: CallerDep,
    label: Annotated[str | None, Query(min_length=1, max_length=MAX_LABEL_CHARS)] = None,
) -> VectorSet:
    """Upload a vector set: the body is a safetensors file (`application/octet-stream`) of 1-D
    `[W]` or 2-D `[n, W]` tensors in F32, F16, BF16 or F64, every value finite. The whole file is
    checked (422 saying what to fix), stored, and answered as its record; interventions name
    `{"vector_id", "name"}`."""
    data = await _body(request, services.settings.vector_max_bytes)
    record = await run_in_threadpool(_upload, services, data, caller, label)
    response.headers["Location"] = str(request.url_for("get_vector_set", vector_id=record.id))
    return record


@router.get("", response_model=list[VectorSet])
def list_vector_sets(
    services: ServicesDep, caller: CallerDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[VectorSet]:
    """The caller's vector sets, newest first (with API keys, only those uploaded with the caller's key)."""
    return _sets(services).list(caller, limit)


@router.get("/{vector_id}", response_model=VectorSet, responses=ERRORS)
def get_vector_set(vector_id: str, services: ServicesDep, caller: CallerDep) -> VectorSet:
    """A vector set's record: its tensors' shapes and dtypes, sha256, size, label and metadata."""
    return _sets(services).get(vector_id, caller, _keys_on(services))


@router.delete("/{vector_id}", status_code=204, responses=ERRORS)
def delete_vector_set(vector_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """Delete a vector set: its file, then its record."""
    _sets(services).delete(vector_id, caller, _keys_on(services))
    return Response(status_code=204)


@router.get("/{vector_id}/file", responses=ERRORS)
def download_vector_set(vector_id: str, services: ServicesDep, caller: CallerDep) -> Response:
    """The set's safetensors file as uploaded (ETag: its sha256), streamed from the store."""
    record = _sets(services).get(vector_id, caller, _keys_on(services))
    headers = {
        "etag": f'"{record.sha256}"',
        "content-disposition": f'attachment; filename="{record.id}.safetensors"',
    }
    path = services.store.local_path(record.key)
    if path is not None:
        if not path.is_file():
            raise VectorSetNotFound(f"the file of vector set {record.id} is no longer in the store")
        return FileResponse(path, media_type="application/octet-stream", headers=headers)
    headers["content-length"] = str(record.bytes)
    return StreamingResponse(services.store.stream(record.key), media_type="application/octet-stream", headers=headers)

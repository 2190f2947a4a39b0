"""Artifact stores: where a job's activations and manifest go. One URL setting picks one.

base.py     ArtifactStore (what every store offers) and the key layout
local.py    LocalStore: a directory (file:///abs/dir)
s3.py       S3Store: AWS, MinIO, SeaweedFS through boto3 (s3://bucket/prefix)
tensors.py  the safetensors format: a file written while hashed; one tensor read by byte range
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from shared.settings import Settings
from shared.storage.base import (
    ArtifactStore,
    activations_key,
    attempt_prefix,
    check_key,
    job_prefix,
    legacy_nnsight_result_key,
    manifest_key,
    nnsight_request_key,
    nnsight_result_key,
)
from shared.storage.local import LocalStore

__all__ = [
    "ArtifactStore",
    "LocalStore",
    "activations_key",
    "attempt_prefix",
    "check_key",
    "job_prefix",
    "legacy_nnsight_result_key",
    "manifest_key",
    "nnsight_request_key",
    "nnsight_result_key",
    "open_store",
]


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
        from shared.storage.s3 import S3Store

        return S3Store(
            parsed.netloc,
            parsed.path,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            chunk_bytes=settings.s3_multipart_chunk_bytes,
            outage_seconds=settings.storage_outage_seconds if wait_for_outages else 0,
            public_endpoint_url=settings.s3_public_endpoint_url,
        )
    raise ValueError(
        f"ACTQ_STORAGE_URL {url!r}: unsupported scheme {parsed.scheme!r} (use file:///abs/dir or s3://bucket/prefix)"
    )

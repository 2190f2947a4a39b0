"""The S3 artifact store (AWS, MinIO, SeaweedFS), through boto3.

Uploads use boto3's transfer manager (multipart above `s3_multipart_chunk_bytes`; an object
appears only when the upload completes, and a failed multipart upload is aborted). Transient
errors are retried by botocore's standard retry mode; connect and read timeouts keep a dead
endpoint from hanging a job. An endpoint that cannot be reached at all is waited for: uploads
are retried with backoff for up to `outage_seconds` (the worker's store: ACTQ_STORAGE_OUTAGE_SECONDS),
so a short S3 outage delays jobs instead of failing them. Credentials come from the standard AWS
chain (environment, config files, instance roles), never from a request. Download links are signed
for `public_endpoint_url` when clients reach the server by another name than the workers do.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import stamina
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, HTTPClientError
from botocore.exceptions import ConnectionError as S3ConnectionError

from shared.errors import StorageError
from shared.outages import STORE, outage
from shared.storage.base import ArtifactStore, check_key

_WORDED_CODE = re.compile(r"An error occurred \((\w+)\)")  # botocore's ClientError text: "An error occurred (Code) ..."
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken"}
# The endpoint out of reach: refused or timed out at connect (ConnectionError), or the connection
# lost mid-request, as when the server stops during an upload's part (HTTPClientError: closed, read timeout).
UNREACHABLE = (S3ConnectionError, HTTPClientError)


class S3Store(ArtifactStore):
    remote = True

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None,
        region: str | None,
        chunk_bytes: int,
        outage_seconds: float = 0,
        public_endpoint_url: str | None = None,
    ) -> None:
        self.bucket = bucket
        self.outage_seconds = outage_seconds
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        config = Config(
            retries={"mode": "standard", "max_attempts": 4},
            connect_timeout=5,
            read_timeout=30,
            signature_version="s3v4",
            s3={"addressing_style": "path" if endpoint_url else "auto"},
        )
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=endpoint_url, region_name=region or None, config=config)
        # Download links are signed for the host clients use (SigV4 signs the Host header, so a link
        # rewritten to another host is refused): a client of its own, never used to send a request.
        self.signer = self.client
        if public_endpoint_url:
            public = config.merge(Config(s3={"addressing_style": "path"}))
            self.signer = session.client(
                "s3", endpoint_url=public_endpoint_url, region_name=region or None, config=public
            )
        self.transfer = TransferConfig(
            multipart_threshold=chunk_bytes, multipart_chunksize=chunk_bytes, use_threads=True
        )
        self.bytes_read = 0  # bytes fetched by read_range: lets tests and benchmarks check partial reads

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _error(self, action: str, key: str, exc: BaseException) -> StorageError:
        where = f"s3://{self.bucket}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")
        code: str | None = None
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
        elif not isinstance(exc, BotoCoreError):  # boto3's wrapper, its chain lost: the code is in its text
            worded = _WORDED_CODE.search(str(exc))
            code = worded[1] if worded else None
        if code is not None:
            if code == "NoSuchBucket":
                return StorageError(f"cannot {action} {key}: bucket {self.bucket!r} does not exist ({where})")
            if code in _CREDENTIAL_CODES:
                return StorageError(f"cannot {action} {key}: S3 rejected the credentials ({code}) for {where}")
            if code in ("NoSuchKey", "404"):
                return StorageError(f"cannot {action} {key}: no such object in {where}")
            return StorageError(f"cannot {action} {key} in {where}: {code or exc}")
        if isinstance(exc, EndpointConnectionError):
            return StorageError(f"cannot {action} {key}: S3 endpoint {self.endpoint_url or 'AWS'} is unreachable")
        if isinstance(exc, UNREACHABLE):  # the connection lost mid-request (an upload's part, a read)
            return StorageError(
                f"cannot {action} {key}: S3 endpoint {self.endpoint_url or 'AWS'} is unreachable "
                f"({type(exc).__name__}: the connection was lost mid-request)"
            )
        return StorageError(f"cannot {action} {key} in {where}: {type(exc).__name__}: {exc}")

    def _upload(self, key: str, call: Callable[[], object]) -> str:
        """Run an upload; while the endpoint is unreachable, retry it for up to outage_seconds."""

        def unreachable(exc: Exception) -> bool:
            return isinstance(_cause(exc), UNREACHABLE)

        waiting = {"attempts": None, "timeout": self.outage_seconds} if self.outage_seconds else {"attempts": 1}
        try:
            for attempt in stamina.retry_context(on=unreachable, wait_initial=0.5, wait_max=5.0, **waiting):
                with attempt:
                    call()
        except Exception as exc:  # boto3's transfer manager wraps errors in S3UploadFailedError
            raise self._error("store", key, _cause(exc)) from exc
        outage(STORE).ok()  # an outage its retries went through (shared/outages.py) has ended
        return self.uri(key)

    def put_file(self, key: str, src: Path, *, sync_folder: bool = True) -> str:
        return self._upload(
            key, lambda: self.client.upload_file(str(src), self.bucket, self._key(key), Config=self.transfer)
        )

    def put_bytes(self, key: str, data: bytes) -> str:
        return self._upload(key, lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    def local_path(self, key: str) -> Path | None:
        return None

    def scratch_dir(self) -> Path:
        scratch = Path(tempfile.gettempdir()) / "actq-upload"
        scratch.mkdir(parents=True, exist_ok=True)
        return scratch

    def delete_prefix(self, prefix: str) -> None:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix) + "/"
            )
            for page in pages:
                objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if objects:
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
        except (BotoCoreError, ClientError) as exc:
            raise self._error("delete", prefix, exc) from exc

    def folders(self, prefix: str) -> list[str]:
        under = self._key(prefix) + "/"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=under, Delimiter="/"
            )
            names = [p["Prefix"][len(under) :].rstrip("/") for page in pages for p in page.get("CommonPrefixes", [])]
        except (BotoCoreError, ClientError) as exc:
            raise self._error("list", prefix, exc) from exc
        return sorted(f"{prefix}/{name}" for name in names if name)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )["Body"]
            data = body.read()
        except (BotoCoreError, ClientError) as exc:
            raise self._error("read", key, exc) from exc
        self.bytes_read += len(data)
        return data

    def stream_range(self, key: str, start: int, length: int, chunk: int = 1 << 20) -> Iterator[bytes]:
        """One HTTP Range request, its body read `chunk` bytes at a time."""
        if length <= 0:
            return
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )["Body"]
        except (BotoCoreError, ClientError) as exc:
            raise self._error("read", key, exc) from exc
        try:
            for data in body.iter_chunks(chunk):
                self.bytes_read += len(data)
                yield data
        finally:
            body.close()

    def stream(self, key: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except (BotoCoreError, ClientError) as exc:
            raise self._error("read", key, exc) from exc
        yield from body.iter_chunks(chunk)

    def presigned_url(self, key: str, expires: int) -> str | None:
        return self.signer.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires
        )

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket"):
                raise StorageError(f"bucket {self.bucket!r} does not exist") from exc
            raise self._error("reach", "the bucket", exc) from exc
        except BotoCoreError as exc:
            raise self._error("reach", "the bucket", exc) from exc


def _cause(exc: BaseException) -> BaseException:
    """The botocore error under boto3's wrappers: S3UploadFailedError keeps it as its context, or
    deeper, under an exception raised while s3transfer handled it (a CI run met that)."""
    chain, seen = [exc], set()
    while chain:
        found = chain.pop(0)
        if id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, (ClientError, BotoCoreError)):
            return found
        chain += [link for link in (found.__cause__, found.__context__) if link is not None]
    return exc

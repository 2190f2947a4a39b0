"""How the S3 store words a failed request (shared/storage/s3.py): a connection refused at connect
and one lost mid-request (an upload's part when the server stops) both say the endpoint is
unreachable, what the outage tests and the CLI's one-line errors rely on."""

from __future__ import annotations

import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

from shared.storage.s3 import S3Store, _cause


def test_a_connection_lost_mid_request_reads_as_an_unreachable_endpoint():
    store = S3Store("b", "p", endpoint_url="http://127.0.0.1:1", region="us-east-1", chunk_bytes=8 << 20)
    url = "http://127.0.0.1:1/b/p/jobs/j/activations.safetensors"
    refused = store._error("store", "jobs/j/a", EndpointConnectionError(endpoint_url=url))
    assert refused.message == "cannot store jobs/j/a: S3 endpoint http://127.0.0.1:1 is unreachable"
    for lost in (ConnectionClosedError(endpoint_url=url), ReadTimeoutError(endpoint_url=url)):
        error = store._error("store", "jobs/j/a", lost)
        assert error.message.startswith("cannot store jobs/j/a: S3 endpoint http://127.0.0.1:1 is unreachable (")
        assert type(lost).__name__ in error.message


def _failed_upload(context: BaseException | None) -> S3UploadFailedError:
    """boto3's wrapper as its upload raised it while `context` was being handled (None: no chain)."""
    text = "Failed to upload /tmp/x to b/p/k: " + str(_rejected())
    try:
        if context is None:
            raise S3UploadFailedError(text)
        try:
            raise context
        except (ClientError, RuntimeError):
            raise S3UploadFailedError(text)  # noqa: B904 - boto3 raises it so, its ClientError as the context
    except S3UploadFailedError as wrapped:
        return wrapped


def _rejected() -> ClientError:
    return ClientError({"Error": {"Code": "SignatureDoesNotMatch", "Message": "bad"}}, "PutObject")


@pytest.mark.parametrize("chain", ["context", "deeper", "lost"])
def test_rejected_credentials_read_as_such_however_boto3_chained_them(chain):
    """An upload's SignatureDoesNotMatch, wrapped in S3UploadFailedError with its ClientError as
    the context, under another exception raised meanwhile, or with no chain at all (a CI run met
    one of the last two): each reads as rejected credentials."""
    store = S3Store("b", "p", endpoint_url="http://127.0.0.1:1", region="us-east-1", chunk_bytes=8 << 20)
    if chain == "context":
        wrapped = _failed_upload(_rejected())
    elif chain == "deeper":
        try:
            try:
                raise _rejected()
            except ClientError:
                raise RuntimeError("cancelled while the error was handled")  # noqa: B904
        except RuntimeError as meanwhile:
            wrapped = _failed_upload(meanwhile)
    else:
        wrapped = _failed_upload(None)
    error = store._error("store", "jobs/j/a", _cause(wrapped))
    assert error.message == "cannot store jobs/j/a: S3 rejected the credentials (SignatureDoesNotMatch) for " + (
        "s3://b at http://127.0.0.1:1"
    )

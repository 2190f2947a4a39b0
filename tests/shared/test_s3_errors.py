"""How the S3 store words a failed request (shared/storage/s3.py): a connection refused at connect
and one lost mid-request (an upload's part when the server stops) both say the endpoint is
unreachable, what the outage tests and the CLI's one-line errors rely on."""

from __future__ import annotations

from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

from shared.storage.s3 import S3Store


def test_a_connection_lost_mid_request_reads_as_an_unreachable_endpoint():
    store = S3Store("b", "p", endpoint_url="http://127.0.0.1:1", region="us-east-1", chunk_bytes=8 << 20)
    url = "http://127.0.0.1:1/b/p/jobs/j/activations.safetensors"
    refused = store._error("store", "jobs/j/a", EndpointConnectionError(endpoint_url=url))
    assert refused.message == "cannot store jobs/j/a: S3 endpoint http://127.0.0.1:1 is unreachable"
    for lost in (ConnectionClosedError(endpoint_url=url), ReadTimeoutError(endpoint_url=url)):
        error = store._error("store", "jobs/j/a", lost)
        assert error.message.startswith("cannot store jobs/j/a: S3 endpoint http://127.0.0.1:1 is unreachable (")
        assert type(lost).__name__ in error.message

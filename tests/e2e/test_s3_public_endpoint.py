"""Download links for clients that reach S3 by another name than the API and workers do
(ACTQ_S3_PUBLIC_ENDPOINT_URL): MinIO in docker compose is http://minio:9000 inside the compose
network and http://localhost:9000 outside it. Here the real S3-compatible server (SeaweedFS,
signatures checked) is 127.0.0.1 to actq and `localhost` to the client."""

from __future__ import annotations

import hashlib
import os

import httpx

from shared.client import Client
from shared.settings import Settings
from shared.storage import open_store
from tests.e2e.conftest import own_stack
from tests.support.s3_server import BUCKET

CAPTURE = {"modules": ["model.layers.1"], "positions": "all"}


def public(endpoint: str) -> str:
    assert endpoint.startswith("http://127.0.0.1:")
    return endpoint.replace("127.0.0.1", "localhost")


def test_a_link_is_signed_for_the_public_endpoint_and_fetches_the_bytes(s3_server, monkeypatch):
    for name, value in s3_server.env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    settings = Settings(
        _env_file=None,
        storage_url=f"s3://{BUCKET}/public-links",
        s3_endpoint_url=s3_server.endpoint,
        s3_public_endpoint_url=public(s3_server.endpoint),
    )
    store = open_store(settings)
    data = os.urandom(100_000)
    store.put_bytes("links/blob.bin", data)

    url = store.presigned_url("links/blob.bin", 60)
    assert url is not None and url.startswith(f"{public(s3_server.endpoint)}/{BUCKET}/public-links/links/blob.bin?")
    fetched = httpx.get(url)  # no credentials: the link alone
    assert fetched.status_code == 200 and fetched.content == data
    # SigV4 signs the host: the same link sent to the internal name is refused, so a link cannot
    # be made for clients by rewriting the host of one signed for the workers' endpoint.
    assert httpx.get(url.replace(public(s3_server.endpoint), s3_server.endpoint)).status_code == 403


def test_the_api_redirects_a_download_to_the_public_endpoint(live_s3, s3_server, tmp_path):
    with live_s3.client() as http:
        body = {"model": "tiny-s3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
        job = live_s3.wait(http, live_s3.submit(http, {**body, "capture": CAPTURE}))
    assert job["status"] == "succeeded", job
    # An API of its own on the same Redis and bucket, told the name clients use for S3.
    overrides = {"ACTQ_STORAGE_URL": live_s3.env["ACTQ_STORAGE_URL"]}
    with own_stack(tmp_path, live_s3.env, **overrides, ACTQ_S3_PUBLIC_ENDPOINT_URL=public(s3_server.endpoint)) as api:
        with api.client() as http:
            redirect = http.get(f"/jobs/{job['id']}/activations")
        assert redirect.status_code == 307
        assert redirect.headers["location"].startswith(f"{public(s3_server.endpoint)}/{BUCKET}/runs/jobs/{job['id']}/")
        with Client(api.base_url) as client:  # the Python client's default download: follow the link
            data = client.job(job["id"]).activations_bytes()
        followed = httpx.get(f"{api.base_url}/jobs/{job['id']}/activations", follow_redirects=True)  # curl -L
    assert hashlib.sha256(data).hexdigest() == job["activations"]["sha256"]
    assert followed.status_code == 200 and followed.content == data
    assert followed.url.host == "localhost"

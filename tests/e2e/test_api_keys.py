"""ACTQ_API_KEYS: every endpoint but /health needs a key; a job belongs to the key that made it."""

from __future__ import annotations

import httpx
import pytest

from tests.support.stack import TINY, TestStack

ALPHA, BETA = "alpha-key-123", "beta-key-456"


@pytest.fixture(scope="module")
def keyed_api(live, tmp_path_factory):
    env = {**live.env, "ACTQ_API_KEYS": f"{ALPHA}, {BETA}"}
    with TestStack(tmp_path_factory.mktemp("keyed"), env) as keyed:
        keyed.start_api()
        yield keyed.base_url


def client(base: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base, headers=headers, timeout=60)


def body(**changes) -> dict:
    return {
        "model": TINY,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "capture": {"modules": ["model.layers.1"]},
        **changes,
    }


def test_missing_or_wrong_keys_are_401_with_a_clear_message(keyed_api):
    for key, message in ((None, "send `Authorization: Bearer <key>`"), ("nope", "the API key is not valid")):
        with client(keyed_api, key) as http:
            for method, path in (
                ("POST", "/jobs"),
                ("POST", "/jobs/batch"),
                ("GET", "/models"),
                ("GET", "/v1/models"),
                ("GET", "/jobs/00000000-0000-4000-8000-000000000000"),
            ):
                response = http.request(method, path, json=body() if method == "POST" else None)
                assert response.status_code == 401, (method, path, response.text)
                assert message in response.text and response.headers["www-authenticate"] == "Bearer"
    with client(keyed_api, None) as http:
        assert http.get("/health").status_code == 200  # health stays open for probes
    with client(keyed_api, "Bearer") as http:
        assert http.get("/models", headers={"Authorization": "Basic abc"}).status_code == 401


def test_another_keys_job_is_404_on_every_route(keyed_api, live):
    with client(keyed_api, ALPHA) as alpha, client(keyed_api, BETA) as beta:
        job_id = alpha.post("/jobs", json=body()).json()["id"]
        job = alpha.get(f"/jobs/{job_id}", params={"wait": 30}).json()
        assert job["status"] == "succeeded"
        for method, path in (
            ("GET", f"/jobs/{job_id}"),
            ("GET", f"/jobs/{job_id}/activations"),
            ("GET", f"/jobs/{job_id}/activations/model.layers.1"),
            ("DELETE", f"/jobs/{job_id}"),
        ):
            response = beta.request(method, path)
            assert response.status_code == 404 and response.json()["error"] == "job_not_found", (path, response.text)
            assert alpha.request("GET", path).status_code == 200 if method == "GET" else True
        assert alpha.get(f"/jobs/{job_id}").json()["status"] == "succeeded"  # beta's DELETE did nothing
        # Idempotency keys are per API key: the same key string makes two jobs for two callers.
        a = alpha.post("/jobs", json=body(capture=None), headers={"Idempotency-Key": "shared"}).json()["id"]
        b = beta.post("/jobs", json=body(capture=None), headers={"Idempotency-Key": "shared"}).json()["id"]
        assert a != b
        batch = beta.post("/jobs/batch", json={"jobs": [{"request": body(capture=None)}]}).json()["jobs"][0]["id"]
        assert alpha.get(f"/jobs/{batch}").status_code == 404 and beta.get(f"/jobs/{batch}").status_code == 200
        listed_alpha = {j["id"] for j in alpha.get("/jobs", params={"limit": 1000}).json()}
        listed_beta = {j["id"] for j in beta.get("/jobs", params={"limit": 1000}).json()}
        assert {job_id, a} <= listed_alpha and not listed_alpha & listed_beta and {b, batch} <= listed_beta
        assert alpha.delete(f"/jobs/{job_id}").status_code == 204
        assert job_id not in {j["id"] for j in alpha.get("/jobs").json()}

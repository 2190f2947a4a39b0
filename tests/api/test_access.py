"""With API keys on: the docs and schema need a key (unless ACTQ_PUBLIC_DOCS), /metrics and counts
across keys (queue positions, queued jobs per model) need an operator key."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.support.models import tiny_llama

USER, OPERATOR = "user-key-1", "operator-key-1"
JOB = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def app_with(settings: Settings, redis_client):
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    registry.publish(tiny_llama())
    registry.heartbeat(tiny_llama(), "test-worker")

    def make(**changes) -> TestClient:
        return TestClient(
            create_app(settings.model_copy(update={"api_keys": USER, "operator_keys": OPERATOR, **changes}))
        )

    return make


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_docs_need_a_key_unless_made_public(app_with, path):
    with app_with() as http:
        assert http.get(path).status_code == 401
        assert http.get(path, headers=bearer(USER)).status_code == 200
    with app_with(public_docs=True) as http:
        assert http.get(path).status_code == 200


def test_metrics_are_for_operators(app_with):
    with app_with() as http:
        assert http.get("/metrics").status_code == 401
        forbidden = http.get("/metrics", headers=bearer(USER))
        assert forbidden.status_code == 403 and "operator key" in forbidden.json()["detail"]
        assert "actq_queue_depth" in http.get("/metrics", headers=bearer(OPERATOR)).text


def test_counts_across_keys_are_for_operators(app_with):
    with app_with() as http:
        job = http.post("/jobs", json=JOB, headers=bearer(USER)).json()["id"]
        assert http.get(f"/jobs/{job}", headers=bearer(USER)).json()["queue_position"] is None
        assert http.get(f"/jobs/{job}", headers=bearer(OPERATOR)).status_code == 404  # not the operator's job
        assert "queued" not in http.get("/health").json()
        assert "queued" not in http.get("/health", headers=bearer(USER)).json()
        assert http.get("/health", headers=bearer(OPERATOR)).json()["queued"] == {"tiny": 1}
        mine = http.post("/jobs", json=JOB, headers=bearer(OPERATOR)).json()["id"]
        assert http.get(f"/jobs/{mine}", headers=bearer(OPERATOR)).json()["queue_position"] == 2

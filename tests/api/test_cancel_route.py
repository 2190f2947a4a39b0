"""POST /jobs/{id}/cancel (`actq cancel`): cancels the caller's own unfinished job and never
deletes anything; another key's job is not found and stays as it was."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.support.models import tiny_llama

OWNER, OTHER = "user-key-1", "user-key-2"
JOB = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": {"run": "r1"}}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def http(settings: Settings, redis_client):
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    registry.publish(tiny_llama())
    registry.heartbeat(tiny_llama(), "test-worker")
    with TestClient(create_app(settings.model_copy(update={"api_keys": f"{OWNER},{OTHER}"}))) as client:
        yield client


def test_cancel_is_the_owners_and_never_deletes(http):
    job = http.post("/jobs", json=JOB, headers=bearer(OWNER)).json()["id"]
    foreign = http.post(f"/jobs/{job}/cancel", headers=bearer(OTHER))
    assert foreign.status_code == 404
    assert http.get(f"/jobs/{job}", headers=bearer(OWNER)).json()["status"] == "queued"

    cancelled = http.post(f"/jobs/{job}/cancel", headers=bearer(OWNER))
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    assert cancelled.json()["error"]["type"] == "cancelled"

    again = http.post(f"/jobs/{job}/cancel", headers=bearer(OWNER))
    assert again.status_code == 409 and again.json()["error"] == "conflict"
    assert again.json()["detail"] == f"job {job} already ended cancelled: there is nothing to cancel"
    assert http.get(f"/jobs/{job}", headers=bearer(OWNER)).json()["status"] == "cancelled"  # kept, not deleted
    listed = http.get("/jobs", params={"metadata.run": "r1"}, headers=bearer(OWNER)).json()
    assert [j["status"] for j in listed] == ["cancelled"]

"""Liveness, readiness and health (api/routes/health.py), with the faults injected for real: a
Redis of the test's own stopped, a local store on a 1 MiB tmpfs filled up."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from tests.support.tmpfs import mounted_tmpfs


def test_live_ready_and_health_while_everything_works(http):
    assert http.get("/livez").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready", "redis": "ok"}
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert health.json()["storage"] == "ok" and health.json()["storage_free_bytes"] > 0


def test_redis_down_fails_readiness_and_health_but_not_liveness(settings, own_redis):
    with TestClient(create_app(settings.model_copy(update={"redis_url": own_redis.url}))) as http:
        assert http.get("/readyz").status_code == 200
        own_redis.stop()
        assert http.get("/livez").status_code == 200
        ready = http.get("/readyz")
        assert ready.status_code == 503 and "Redis cannot be reached" in ready.json()["detail"], ready.text
        assert http.get("/health").status_code == 503
        own_redis.start()
        assert http.get("/readyz").status_code == 200


def test_a_local_store_low_on_space_is_degraded_with_the_bytes_left(settings, tmp_path):
    """A 1 MiB tmpfs: under the default threshold (1 GiB) at once; under a 256 KiB one only once
    a file leaves less than that. Still 200: jobs run, but someone should look."""
    with mounted_tmpfs(tmp_path / "small", "1m") as mount:
        on_tmpfs = settings.model_copy(update={"storage_url": mount.as_uri()})
        with TestClient(create_app(on_tmpfs)) as http:
            health = http.get("/health")
            assert health.status_code == 200, health.text
            body = health.json()
            assert body["status"] == "degraded" and 0 < body["storage_free_bytes"] <= 1 << 20, body
            assert body["storage"] == (
                f"low: {body['storage_free_bytes']} bytes free, under ACTQ_STORAGE_MIN_FREE_BYTES ({1 << 30})"
            )
            assert http.get("/readyz").status_code == 200  # jobs can still be taken
        with TestClient(create_app(on_tmpfs.model_copy(update={"storage_min_free_bytes": 256 << 10}))) as http:
            assert http.get("/health").json()["storage"] == "ok"
            (mount / "filler").write_bytes(b"\0" * ((1 << 20) - (128 << 10)))
            body = http.get("/health").json()
            assert body["status"] == "degraded" and body["storage_free_bytes"] <= 128 << 10, body
            assert body["storage"].startswith("low: "), body


@pytest.mark.parametrize("path", ["/livez", "/readyz"])
def test_probes_need_no_key(path, settings):
    with TestClient(create_app(settings.model_copy(update={"api_keys": "sekrit-key"}))) as http:
        assert http.get("/jobs").status_code == 401  # keys are on
        assert http.get(path).status_code == 200

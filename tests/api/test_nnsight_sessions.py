"""nnsight's WebSocket session (`/subscribe`) on the real app over a real Redis, with no worker:
the statuses of the jobs sent with a session reach its socket, every one of them and no other
key's. The jobs stay queued, so each sends one QUEUED status."""

from __future__ import annotations

import json
import platform

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse

from api.main import create_app
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.api.conftest import LIMITS
from tests.api.test_nnsight_requests import CLASS, PAYLOAD, served_dir, served_info  # noqa: F401 - a fixture

FIRST, SECOND = "trusted-key-first-0123456789", "trusted-key-second-0123456789"


@pytest.fixture
def settings(redis_server, tmp_path) -> Settings:
    return Settings(
        redis_url=redis_server.url,
        storage_url=(tmp_path / "data").as_uri(),
        api_keys=f"{FIRST},{SECOND}",
        nnsight_keys=f"{FIRST},{SECOND}",
        max_queued_jobs_per_key=1000,
        max_long_polls=4,
        max_long_polls_per_key=2,
        **LIMITS,
    )


@pytest.fixture
def http(settings, redis_client, served_dir):  # noqa: F811 - the fixture imported above
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    info = served_info(served_dir)
    registry.publish(info)
    registry.heartbeat(info, "worker-tiny")
    with TestClient(create_app(settings)) as client:
        yield client


def send(http: TestClient, served_dir, session: str, key: str) -> str:  # noqa: F811
    model_key = f"{CLASS}:" + json.dumps({"repo_id": str(served_dir), "revision": None})
    data = json.dumps({"model_key": model_key, "session_id": session, "compress": False, "env": {}})
    headers = {"ndif-api-key": key, "nnsight-version": "0.8.1", "python-version": platform.python_version()}
    response = http.post("/request", data={"data": data}, files={"blob": ("request", PAYLOAD)}, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_another_key_that_knows_a_session_id_sends_nothing_into_that_session(http, served_dir):  # noqa: F811
    """The second key sends with the first key's session id (as a hostile round did: it made the
    first key's socket show an ERROR for a job it never sent); the first key's socket hears only
    of its own job."""
    with http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as socket:
        session = socket.receive_json()["session_id"]
        intruder = send(http, served_dir, session, SECOND)
        own = send(http, served_dir, session, FIRST)
        heard = socket.receive_json()
    assert heard["id"] == own != intruder and heard["status"] == "QUEUED", heard


def test_every_job_of_a_long_session_gets_its_status(http, served_dir):  # noqa: F811
    """150 jobs in one session (statuses stopped after the 100th before)."""
    with http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as socket:
        session = socket.receive_json()["session_id"]
        sent = [send(http, served_dir, session, FIRST) for _ in range(150)]
        heard = [socket.receive_json() for _ in sent]
    assert sorted(f["id"] for f in heard) == sorted(sent)
    assert {f["status"] for f in heard} == {"QUEUED"}


def test_one_keys_sessions_cannot_take_every_other_keys_long_poll(http, served_dir):  # noqa: F811
    """Issue 47: 2,000 idle sessions of one key took the process's every long-poll place, and the
    2,001st got a session id and was then closed. A key holds at most ACTQ_MAX_LONG_POLLS_PER_KEY
    (2 here) places: its third socket is refused before any session id, with a 429 that names the
    setting, while the other key still opens a session and long-polls a job."""
    with (
        http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as one,
        http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as two,
    ):
        assert one.receive_json()["session_id"] and two.receive_json()["session_id"]
        with pytest.raises(WebSocketDenialResponse) as refused:
            with http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}):
                pass
        assert refused.value.status_code == 429 and refused.value.headers["retry-after"]
        assert "ACTQ_MAX_LONG_POLLS_PER_KEY" in refused.value.json()["detail"]
        with http.websocket_connect("/subscribe", headers={"ndif-api-key": SECOND}) as other:
            session = other.receive_json()["session_id"]
            job = send(http, served_dir, session, SECOND)
            assert other.receive_json()["id"] == job
            polled = http.get(f"/jobs/{job}", params={"wait": 0.2}, headers={"Authorization": f"Bearer {SECOND}"})
            assert polled.status_code == 200, polled.text
    with http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as again:  # places given back
        assert again.receive_json()["session_id"]


def test_past_the_processs_long_polls_a_socket_is_refused_before_its_session_id(http):
    """At ACTQ_MAX_LONG_POLLS (4 here) the next socket gets a 429, not a session id and a close."""
    with (
        http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as a,
        http.websocket_connect("/subscribe", headers={"ndif-api-key": FIRST}) as b,
        http.websocket_connect("/subscribe", headers={"ndif-api-key": SECOND}) as c,
        http.websocket_connect("/subscribe", headers={"ndif-api-key": SECOND}) as d,
    ):
        assert all(s.receive_json()["session_id"] for s in (a, b, c, d))
        with pytest.raises(WebSocketDenialResponse) as refused:
            with http.websocket_connect("/subscribe", headers={"ndif-api-key": SECOND}):
                pass
        assert refused.value.status_code == 429
        assert "ACTQ_MAX_LONG_POLLS" in refused.value.json()["detail"]

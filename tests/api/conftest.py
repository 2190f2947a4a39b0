"""The real app in this process (FastAPI's TestClient speaks HTTP to it through ASGI) over a real
Redis emptied before each test, with a model description published as a worker would. No worker
and no API process: these tests check what the API decides on its own."""

from __future__ import annotations

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from shared.cli.redis_server import RedisServer
from shared.registry import ModelRegistry
from shared.settings import Settings
from tests.support.models import tiny_llama

LIMITS = {"max_tokens_limit": 200, "default_max_tokens": 16, "capture_budget_bytes": 20_000_000}
COUNT_WAIT_SECONDS = 0.2  # what a long prompt's count waits here for a tokenizer that never answers


@pytest.fixture(autouse=True)
def no_tokenizer_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests list live workers but run none, so no tokenizer answers the count of a long
    prompt (api/context_check.py) and the API goes on without it: after 0.2 s here, not the
    shipped 2 s (a chat to the tiny model's 256-token context is always counted)."""
    monkeypatch.setattr("api.context_check.COUNT_WAIT_SECONDS", COUNT_WAIT_SECONDS)


@pytest.fixture
def settings(redis_server: RedisServer, tmp_path) -> Settings:
    return Settings(redis_url=redis_server.url, storage_url=(tmp_path / "data").as_uri(), **LIMITS)


@pytest.fixture
def http(settings: Settings, redis_client: redis.Redis):
    """The app over HTTP, with `tiny` and `tiny-base` (no chat template) known, each with a live worker."""
    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    for info in (tiny_llama(), tiny_llama("tiny-base").model_copy(update={"chat_template": False})):
        registry.publish(info)
        registry.heartbeat(info, f"worker-{info.name}")
    with TestClient(create_app(settings)) as client:
        yield client

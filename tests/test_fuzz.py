"""schemathesis generates requests from the API's own OpenAPI schema (coverage, fuzzing and
stateful phases): at least 1,000 of them, no 5xx, no request that hangs past 10 s."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shared import stack
from shared.redis_server import RedisServer, free_port
from shared.registry import ModelRegistry
from shared.schemas import ModelInfo, ModuleInfo
from tests.conftest import health_when_up

pytestmark = pytest.mark.slow


def test_the_api_never_answers_5xx_to_generated_requests(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        # A served model with no worker: valid jobs are queued, none run.
        modules = [ModuleInfo(path=f"model.layers.{i}", output_dim=8, input_dim=8, all_positions=True) for i in range(4)]
        info = ModelInfo(name="tiny", source="x", architecture="A", num_layers=4, hidden_size=8, vocab_size=10,
                         max_context=256, dtype="float32", device="cpu", modules=modules)  # fmt: skip
        ModelRegistry(redis.Redis.from_url(server.url), 20).publish(info)
        port = free_port()
        env = {"ACTQ_REDIS_URL": server.url, "ACTQ_STORAGE_URL": (tmp_path / "data").as_uri()}
        api = stack.start_api(env, tmp_path / "api.log", port)
        try:
            health_when_up(f"http://127.0.0.1:{port}")
            st = Path(sys.executable).parent / "st"
            cmd = [str(st), "run", f"http://127.0.0.1:{port}/openapi.json", "--checks", "not_a_server_error",
                   "--max-examples", "60", "--request-timeout", "10", "--no-color", "--seed", "1"]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        finally:
            stack.stop(api)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", out).groups())
    assert generated >= 1000 and passed == generated, out[-2000:]

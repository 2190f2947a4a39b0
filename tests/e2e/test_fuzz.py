"""schemathesis generates requests from the API's own OpenAPI schema (coverage, fuzzing and
stateful phases): at least 1,000 of them, no 5xx, no request that hangs past 10 s."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shared.cli.redis_server import RedisServer
from shared.registry import ModelRegistry
from tests.support.models import tiny_llama
from tests.support.stack import TestStack

pytestmark = pytest.mark.slow


def test_the_api_never_answers_5xx_to_generated_requests(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        # A served model with no worker: valid jobs are queued, none run.
        info = tiny_llama()
        ModelRegistry(redis.Redis.from_url(server.url), 20).publish(info)
        env = {"ACTQ_REDIS_URL": server.url, "ACTQ_STORAGE_URL": (tmp_path / "data").as_uri()}
        with TestStack(tmp_path, env) as s:
            s.start_api()
            st = Path(sys.executable).parent / "st"
            cmd = [
                str(st),
                "run",
                f"{s.base_url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "60",
                "--request-timeout",
                "10",
                "--no-color",
                "--seed",
                "1",
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", out).groups())
    assert generated >= 1000 and passed == generated, out[-2000:]

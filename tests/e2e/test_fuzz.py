"""schemathesis generates requests from the API's own OpenAPI schema (coverage, fuzzing and
stateful phases), over every route, the bodies of /jobs, /jobs/batch and /v1/* included (they are
documented although parsed off the event loop: api/bodies.py): at least 1,000 of them, no 5xx, no
request that hangs past 10 s, and a 4xx never leaves a job, a queued message or a vector set
behind (tests/support/fuzz_hooks.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shared.cli.redis_server import RedisServer
from shared.registry import ModelRegistry
from shared.tools import ToolFormat
from tests.support.models import tiny_llama
from tests.support.stack import TestStack

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_api_never_answers_5xx_to_generated_requests(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        # A served model with no worker: valid jobs are queued, none run.
        info = tiny_llama().model_copy(update={"tool_format": ToolFormat.HERMES})  # tools reach the schema checks
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
                "not_a_server_error,nothing_queued_on_4xx",
                "--max-examples",  # per operation: 5,622 requests in all at 20, 6,969 at 60 (at least 1,000 asked)
                "20",
                "--request-timeout",
                "10",
                "--no-color",
                "--seed",
                "1",
            ]
            hooks = {"SCHEMATHESIS_HOOKS": "tests.support.fuzz_hooks", "ACTQ_FUZZ_REDIS_URL": server.url}
            env = {**os.environ, **hooks, "PYTHONPATH": str(ROOT)}
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", out).groups())
    assert generated >= 1000 and passed == generated, out[-2000:]
    print(f"\nschemathesis: {generated} generated, {passed} passed")

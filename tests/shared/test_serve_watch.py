"""`actq serve`'s bookkeeping: bounded restarts per process, and the warning when the store shares
Redis's filesystem."""

from __future__ import annotations

import pytest

from shared.cli.serve import Restarts, _restart_or_stop, shared_filesystem_warning
from shared.errors import ToolError
from tests.support.tmpfs import mounted_tmpfs


def test_restarts_are_bounded_per_process_within_the_window():
    restarts = Restarts(limit=3, window=60)
    said: list[str] = []
    for _ in range(3):
        _restart_or_stop(restarts, "Redis", 1, "No space left on device", said.append)
    assert said[-1] == (
        "Redis exited with code 1 (No space left on device); starting it again (3 of 3 restarts allowed in 60 s)"
    )
    assert restarts.allow("worker-serve") == 1  # each process has its own count
    with pytest.raises(ToolError, match="Redis exited with code 1 .*its 4th exit within 60 s; stopping the rest"):
        _restart_or_stop(restarts, "Redis", 1, "No space left on device", said.append)
    assert Restarts(limit=1, window=0).allow("api") == 1


def test_a_store_on_redis_filesystem_is_warned_about(tmp_path):
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    warning = shared_filesystem_warning(redis_dir, (tmp_path / "store").as_uri())
    assert warning is not None and "share one filesystem" in warning
    assert shared_filesystem_warning(redis_dir, "s3://bucket/prefix") is None
    with mounted_tmpfs(tmp_path / "other", "1m") as other:
        assert shared_filesystem_warning(redis_dir, (other / "store").as_uri()) is None

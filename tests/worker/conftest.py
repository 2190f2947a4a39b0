"""Fixtures the worker's finishing tests share: a job store on the test's Redis and a local
artifact store (the folder the settings' `storage_url` names, so the API reads the same files)."""

from __future__ import annotations

import pytest

from shared.jobs import JobStore
from shared.storage import LocalStore


@pytest.fixture
def jobs(redis_client) -> JobStore:
    return JobStore(redis_client, retention_seconds=600)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "data")

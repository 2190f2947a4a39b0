"""Settings come from ACTQ_* variables, are checked as a whole, and guard the worker's timeouts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.broker import check_timeouts
from shared.errors import ConfigurationError
from shared.settings import Settings


def test_environment_overrides_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("ACTQ_MAX_TOKENS_LIMIT", "77")
    monkeypatch.setenv("ACTQ_MODEL", str(tmp_path))
    settings = Settings()
    assert settings.max_tokens_limit == 77
    assert settings.max_tokens_default == 77  # the default never exceeds the limit
    assert settings.served_model_name == tmp_path.name  # a local folder is served by its name
    assert Settings(model="Qwen/Qwen3-0.6B").served_model_name == "Qwen/Qwen3-0.6B"
    assert Settings(model="x", model_name="short").served_model_name == "short"


def test_inconsistent_limits_are_refused():
    with pytest.raises(ValidationError, match="ACTQ_JOB_SOFT_TIME_LIMIT must be below"):
        Settings(job_soft_time_limit=100, job_time_limit=100)
    with pytest.raises(ValidationError, match="ACTQ_HEARTBEAT_TTL must exceed"):
        Settings(heartbeat_interval=10, heartbeat_ttl=5)


def test_worker_refuses_a_visibility_timeout_below_the_hard_limit():
    check_timeouts(Settings(visibility_timeout=3600, job_soft_time_limit=100, job_time_limit=200))
    with pytest.raises(ConfigurationError, match="ACTQ_VISIBILITY_TIMEOUT"):
        check_timeouts(Settings(visibility_timeout=100, job_soft_time_limit=100, job_time_limit=200))


@pytest.mark.parametrize("value", ["localhost:9000", "minio", "ftp://minio:9000", "http://"])
def test_a_public_s3_endpoint_without_scheme_or_host_is_refused_naming_the_fix(value):
    with pytest.raises(ValidationError, match=r"is not an endpoint: give http\(s\)://host\[:port\]"):
        Settings(_env_file=None, s3_public_endpoint_url=value)
    assert Settings(_env_file=None, s3_public_endpoint_url="").s3_public_endpoint_url is None  # empty: unset
    assert Settings(_env_file=None, s3_public_endpoint_url="https://s3.example.org").s3_public_endpoint_url

"""The server's default capture (api/default_capture.py): which default a request gets, that its
own capture and the key's default win, a default that cannot apply is a 400 naming the setting,
and a broken setting stops the API at start with a message saying what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.default_capture import with_default_capture
from api.deps import key_id
from shared.errors import CaptureSpecError
from shared.schemas import CaptureSpec, JobRequest
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
KEY, OTHER = "alpha-key-123", "beta-key-456"
MODEL_DEFAULT = {"modules": ["model.layers.1"], "positions": "last"}
KEY_DEFAULT = {"preset": "residual", "layers": [0]}


def settings(**fields: object) -> Settings:
    return Settings(api_keys=f"{KEY},{OTHER}", **fields)


def completion(**fields: object) -> JobRequest:
    return JobRequest.model_validate({"model": "tiny", "prompt": "2 + 2 =", "max_tokens": 2, **fields})


def test_no_default_leaves_the_request_as_it_is():
    request = completion()
    assert with_default_capture(settings(), request, key_id(KEY)) is request


def test_the_models_default_then_the_keys_and_the_requests_own_wins():
    both = settings(
        default_capture_by_model=json.dumps({"tiny": MODEL_DEFAULT}),
        default_capture_by_key=json.dumps({KEY: KEY_DEFAULT}),
    )
    assert with_default_capture(both, completion(), key_id(OTHER)).capture == CaptureSpec(**MODEL_DEFAULT)
    assert with_default_capture(both, completion(), None).capture == CaptureSpec(**MODEL_DEFAULT)
    assert with_default_capture(both, completion(), key_id(KEY)).capture == CaptureSpec(**KEY_DEFAULT)
    assert with_default_capture(both, completion(model="other"), key_id(OTHER)).capture is None
    own = completion(capture={"modules": ["model.layers.3"]})
    assert with_default_capture(both, own, key_id(KEY)) is own
    # nothing else of the request changes
    defaulted = with_default_capture(both, completion(metadata={"run": "x"}, seed=3), key_id(KEY))
    assert defaulted.model_dump(exclude={"capture"}) == completion(metadata={"run": "x"}, seed=3).model_dump(
        exclude={"capture"}
    )


def test_a_default_that_cannot_apply_is_a_400_naming_the_setting():
    generated = settings(
        default_capture_by_model=json.dumps({"tiny": {"preset": "residual", "positions": "generated"}})
    )
    trace = completion(mode="trace", max_tokens=None)
    with pytest.raises(CaptureSpecError, match=r"server's default \(ACTQ_DEFAULT_CAPTURE_BY_MODEL for 'tiny'\)"):
        with_default_capture(generated, trace, None)
    assert with_default_capture(generated, completion(), None).capture.positions == "generated"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ACTQ_DEFAULT_CAPTURE_BY_MODEL": "{tiny: residual}"}, "default_capture_by_model\n  Value error, is not JSON"),
        ({"ACTQ_DEFAULT_CAPTURE_BY_MODEL": '{"tiny": {"positions": "all"}}'}, "name what to capture"),
        ({"ACTQ_DEFAULT_CAPTURE_BY_MODEL": '{"tiny": {"preset": "residual", "positionz": 1}}'}, "positionz"),
        (
            {"ACTQ_API_KEYS": KEY, "ACTQ_DEFAULT_CAPTURE_BY_KEY": json.dumps({"not-a-key": KEY_DEFAULT})},
            "ACTQ_DEFAULT_CAPTURE_BY_KEY names 1 key(s) (not-...) that are not in ACTQ_API_KEYS",
        ),
        (
            {"ACTQ_API_KEYS": KEY, "ACTQ_NNSIGHT_KEYS": "not-a-key"},
            "ACTQ_NNSIGHT_KEYS names 1 key(s) (not-...) that are not in ACTQ_API_KEYS",
        ),
    ],
)
def test_a_broken_default_stops_the_api_at_start(env, message, tmp_path):
    """`uvicorn api.main:app` imports the app, which reads the settings: the process ends there."""
    done = subprocess.run(
        [sys.executable, "-c", "import api.main"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and message in done.stderr, done.stderr[-3000:]
    assert "Traceback" in done.stderr and "validation error for Settings" in done.stderr


def test_the_settings_take_the_defaults_as_json_or_as_objects():
    given = settings(default_capture_by_key={KEY: KEY_DEFAULT}, default_capture_by_model="")
    assert given.default_capture_by_key[KEY].preset == "residual" and given.default_capture_by_model == {}
    with pytest.raises(ValidationError, match="layers"):
        settings(default_capture_by_model={"tiny": {"modules": ["model.layers.1"], "layers": [1]}})

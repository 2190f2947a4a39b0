"""Tensor names in download URLs never reach the filesystem."""

from __future__ import annotations

import pytest

from tests.support.stack import TINY


@pytest.mark.parametrize("name", ["..%2F..%2Fetc%2Fpasswd", "__metadata__", "model.layers.1%00", "%2e%2e"])
def test_tensor_names_cannot_reach_the_filesystem(live, http, name):
    job = live.wait(
        http,
        live.submit(
            http,
            {
                "model": TINY,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "capture": {"modules": ["model.layers.1"]},
            },
        ),
    )
    response = http.get(f"/jobs/{job['id']}/activations/{name}")
    assert response.status_code == 404, response.text

"""/docs in a real browser, with nothing but the API to reach: headless Chromium renders Swagger
UI's list of operations from the app's own files (issue 47: the page was blank offline, its
scripts being on a CDN). ReDoc is checked the same way."""

from __future__ import annotations

import subprocess

from tests.support.browser import chromium, flags


def rendered(url: str, profile: str) -> str:
    command = [chromium(), *flags(profile, 15), "--dump-dom", url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120).stdout


def test_swagger_ui_lists_the_operations_in_headless_chromium(live, tmp_path):
    dom = rendered(live.base_url + "/docs", str(tmp_path / "profile"))
    assert 'class="swagger-ui' in dom, dom[-2000:]
    assert dom.count('class="opblock opblock-') >= 10, dom[-2000:]  # one block per operation
    assert "/v1/chat/completions" in dom and "/jobs/{job_id}" in dom


def test_redoc_renders_the_api_in_headless_chromium(live, tmp_path):
    dom = rendered(live.base_url + "/redoc", str(tmp_path / "profile"))
    assert "/v1/chat/completions" in dom and "actq" in dom, dom[-2000:]

"""Headless Chromium (Debian's `chromium`) as the browser tests drive it: offline, no profile
shared between runs. The tests skip where it is not installed (`make test` installs it when it can)."""

from __future__ import annotations

import shutil

import pytest


def chromium() -> str:
    """The browser's path; skips the test when there is none."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make test installs it when it can: apt-get install chromium)")
    return browser


def flags(profile: str, seconds: int) -> list[str]:
    """Headless, offline and quiet, with a profile of its own; `seconds` of virtual time for the page's scripts."""
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={seconds * 1000}",
        "--window-size=1400,900",
    ]

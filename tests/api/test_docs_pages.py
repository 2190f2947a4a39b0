"""/docs and /redoc render with no internet: every script, stylesheet and icon they reference is
served by the app itself, with its content type (issue 47: Swagger's files came from a CDN, so the
page was blank offline)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

ASSET = re.compile(r"""\b(?:src|href|spec-url)\s*=\s*['"]([^'"]+)['"]|\burl\s*:\s*['"]([^'"]+)['"]""")
TYPES = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


def referenced(page: str) -> list[str]:
    """The URLs a docs page loads: <script src>, <link href>, and the schema (Swagger's `url`,
    ReDoc's `spec-url`)."""
    return [a or b for a, b in ASSET.findall(page)]


@pytest.mark.parametrize(("path", "least", "library"), [("/docs", 3, "SwaggerUIBundle"), ("/redoc", 2, "Redoc")])
def test_docs_pages_load_only_local_files_each_served_with_its_type(http, path, least, library):
    page = http.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = referenced(page.text)
    assets = [u for u in urls if u != "/openapi.json"]
    assert len(assets) >= least, urls  # a script, a stylesheet or fonts, an icon
    for url in urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), f"{path} loads {url} from elsewhere"
    assert "/openapi.json" in urls
    for url in assets:
        served = http.get(url)
        expected = TYPES[url[url.rindex(".") :]]
        assert served.status_code == 200, url
        assert served.headers["content-type"].startswith(expected), (url, served.headers["content-type"])
        assert len(served.content) > 1000, url  # the file itself, not an error page
    scripts = [http.get(u).text for u in assets if u.endswith(".js")]
    assert scripts and library in scripts[0]  # the page's own library, which it then calls
    assert http.get("/openapi.json").json()["info"]["title"] == "actq"


def test_the_docs_files_are_not_a_door_to_other_files(http):
    for path in ("/docs-assets/../../api/main.py", "/docs-assets/%2e%2e/__init__.py", "/docs-assets/missing.js"):
        assert http.get(path).status_code == 404, path

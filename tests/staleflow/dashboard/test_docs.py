"""The OpenAPI pages /docs (Swagger UI) and /redoc work offline: every script, style sheet,
icon and spec they load is served by the app itself (from the ``fastapi-offline``
package), and the HTML names no other host (no CDN, no Google fonts)."""

from __future__ import annotations

import re
from urllib.parse import urljoin, urlsplit

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from staleflow.dashboard.app import create_app
from tests.staleflow.dashboard.fakes import FakeSource

BASE = "http://testserver/"

# where a page names something to load: attributes, Swagger UI's spec url, ReDoc's spec-url
_REFS = re.compile(r"""(?:\bsrc|\bhref|\bspec-url|\burl)\s*[=:]\s*["']([^"']+)["']""")
_ABSOLUTE = re.compile(r"""(?:https?:)?//[^\s"'<>)]+""", re.IGNORECASE)


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(FakeSource()), base_url=BASE.rstrip("/"))


def _refs(html: str) -> list[str]:
    return [u for u in _REFS.findall(html) if not u.startswith(("data:", "#", "javascript:"))]


@pytest.mark.parametrize(
    ("page", "marker", "assets"),
    [
        ("/docs", "SwaggerUIBundle", ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")),
        ("/redoc", "<redoc", ("redoc.standalone.js", "favicon.png")),
    ],
)
def test_docs_pages_load_everything_from_the_app(client, page, marker, assets):
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    # the browser may load nothing from another host (ReDoc's bundle would fetch a logo)
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "img-src 'self' data:" in csp
    assert "http" not in csp and "*" not in csp
    html = r.text
    assert marker in html
    # no URL to another host anywhere in the page (scripts, styles, fonts, links)
    for url in _ABSOLUTE.findall(html):
        host = urlsplit(url if "://" in url else "http:" + url).hostname
        assert host == "testserver", f"{page} references {url}"
    assert "fonts.googleapis" not in html and "cdn" not in html.lower()
    refs = _refs(html)
    for name in assets:
        assert any(ref.endswith("/" + name) for ref in refs), (page, name, refs)
    assert "/openapi.json" in refs
    # ... and each of them is served here
    for ref in refs:
        url = urljoin(BASE + page.lstrip("/"), ref)
        assert urlsplit(url).hostname == "testserver", ref
        got = client.get(url)
        assert got.status_code == 200, (page, ref, got.status_code)
        assert len(got.content) > 100, (page, ref)
        if ref.endswith(".js"):
            assert "javascript" in got.headers["content-type"], ref
        elif ref.endswith(".css"):
            assert got.headers["content-type"].startswith("text/css"), ref


def test_the_spec_the_docs_show_is_the_apps(client):
    spec = client.get("/openapi.json").json()
    assert spec["info"]["title"] == "StaleFlow dashboard"
    assert "/api/overview" in spec["paths"] and "/api/actions/{action}" in spec["paths"]
    # the docs machinery itself is not part of the API
    assert not any(p.startswith(("/docs", "/redoc", "/static")) for p in spec["paths"])


def test_only_the_docs_pages_carry_the_policy(client):
    assert "content-security-policy" not in client.get("/").headers
    assert "content-security-policy" not in client.get("/api/run").headers


def test_swagger_oauth2_redirect_page_is_served(client):
    html = client.get("/docs").text
    assert "/docs/oauth2-redirect" in html
    assert client.get("/docs/oauth2-redirect").status_code == 200


def test_the_page_footer_links_to_the_docs(client):
    html = client.get("/").text
    footer = re.search(r"<footer>(.*?)</footer>", html, re.DOTALL)
    assert footer is not None
    anchors = re.findall(r'<a href="([^"]+)">([^<]+)</a>', footer.group(1))
    links = {text: href for href, text in anchors}
    assert "/docs" in links and "/metrics" in links, links
    docs = client.get(urljoin(BASE, links["/docs"]))
    assert docs.status_code == 200 and "SwaggerUIBundle" in docs.text
    assert client.get(urljoin(BASE, links["/metrics"])).status_code == 200

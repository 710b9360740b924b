"""The API page works offline: /docs names no other host, and its scripts and styles come from the server
(without the API key, as the page itself)."""

from __future__ import annotations

import re

import httpx


def test_the_api_page_loads_nothing_from_elsewhere(idle):
    page = httpx.get(f"{idle.url}/docs", timeout=30)
    assert page.status_code == 200 and "swagger" in page.text.lower()
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sources and all(s.startswith("/") for s in sources), sources
    assert "http://" not in page.text.replace(idle.url, "") and "https://" not in page.text
    for source in sources:
        asset = httpx.get(f"{idle.url}{source}", timeout=30)  # no Authorization header
        assert asset.status_code == 200 and len(asset.content) > 100, source
    assert httpx.get(f"{idle.url}/docs/assets/swagger-ui.css").headers["content-type"].startswith("text/css")
    assert httpx.get(f"{idle.url}/v1/models").status_code == 401  # the API still needs the key

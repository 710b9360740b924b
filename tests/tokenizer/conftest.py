"""Fixtures the tokenizer tests share."""

from __future__ import annotations

import pytest

from kvserve import native


@pytest.fixture
def no_kernels(monkeypatch):
    """The native libraries off (``KVSERVE_NATIVE=0``) for one test; their caches cleared on both sides."""
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    native.load.cache_clear()
    native.function.cache_clear()
    yield
    monkeypatch.delenv("KVSERVE_NATIVE")
    native.load.cache_clear()
    native.function.cache_clear()

"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from kvserve import native
from tests.native.isa_cases import skip_unless_runnable


@pytest.fixture
def path_build(monkeypatch):
    """Selects a path for every kernel built while the test runs (KVSERVE_ISA), and forgets the builds
    after."""

    def select(isa: str) -> None:
        skip_unless_runnable(isa)
        monkeypatch.setenv("KVSERVE_ISA", isa)
        native.load.cache_clear()
        native.function.cache_clear()

    yield select
    native.load.cache_clear()
    native.function.cache_clear()

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kvserve.models.registry import resolve

    return resolve("smollm2")

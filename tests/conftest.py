"""Fixtures shared by every test package: the real SmolLM2 (loaded once), tiny random models, and a
leak check for engines."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# The suite gates every landing, so by default each property test draws the same examples every run
# (a failure is reproducible, never luck); HYPOTHESIS_PROFILE=explore draws fresh ones to hunt for bugs.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

from kvserve.models.loader import load_model
from tests.support import write_tiny_llama


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_q4():
    """SmolLM2 in the fast decode format: Q4_1 tensors as 4-bit groups, the Q8_0 head as int8."""
    return load_model("smollm2", weight_format="q4")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return load_model(str(write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))))


@pytest.fixture(scope="session")
def tiny_llama_hd64(tmp_path_factory):
    """head_dim 64, so every KV codec (32-element groups, power-of-two rotations) applies."""
    return load_model(str(write_tiny_llama(tmp_path_factory.mktemp("tiny_llama_hd64"), seed=1, hidden=256)))


@pytest.fixture
def check_no_leaks():
    """Yields a list to register engines in; fails the test if any of them ends with blocks allocated."""
    engines = []
    yield engines
    for e in engines:
        assert not e.has_unfinished_requests()
        held = [b.block_id for b in e.kv.full.pool.blocks if b.ref_count]
        assert not held, f"blocks still allocated after the test: {held}"
        assert e.kv.full.pool.num_free_blocks == e.kv.num_blocks
        for window in e.kv.tied:  # all free but the null block, which is never handed out
            assert window.num_held_blocks() == 0 and not window.tables, window.tables

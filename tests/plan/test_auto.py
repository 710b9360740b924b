"""--cache-type auto and --kv-cache-memory auto, and the advice when a prompt does not fit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.config import ModelConfig
from kvserve.kv.cache_types import pool_bytes
from kvserve.kv.type_choice import QUALITY_ORDER, choose_cache_types, context_advice, context_pool_bytes
from kvserve.plan.auto import resolve_auto

SMOLLM2 = ModelConfig("llama", 30, 576, 1536, 9, 3, 64, 49152, 8192)
MiB = 1 << 20


def test_quality_order_is_sorted_by_measured_kld():
    klds = [kld for _, _, kld in QUALITY_ORDER]
    assert klds == sorted(klds)


@pytest.mark.parametrize("budget_mib,expected", [(100, ("f16", "f16")), (30, ("q8_0", "q8_0")),
                                                 (20, ("q8_0", "tq4")), (12, ("tq4", "tq4")),
                                                 (7, ("tq2", "tq2"))])
def test_auto_picks_the_best_type_that_fits(budget_mib, expected):
    k, v, reason = choose_cache_types(SMOLLM2, 2048, 1, 16, budget_mib * MiB)
    assert (k, v) == expected
    assert pool_bytes(SMOLLM2, 2048, 1, 16, k, v) <= budget_mib * MiB
    assert "fits" in reason and f"K {k} / V {v}" in reason


def test_auto_sizes_the_window_pool_as_the_engine_does():
    """A model with sliding layers: the pool the engine allocates (global layers every token, sliding
    layers their window) is what auto needs, and it fits where every layer every token would not."""
    import torch

    from kvserve.config import CacheConfig
    from kvserve.engine.engine import pool_size
    from kvserve.kv.storage import PagedKVStorage

    gemma = ModelConfig("gemma3", 6, 64, 128, 2, 1, 32, 256, 8192, sliding_window=64,
                        sliding_window_layers=(True, True, False, True, True, False))
    every_token = pool_bytes(gemma, 4096, 2, 16, "f16", "f16")
    k, v, _ = choose_cache_types(gemma, 4096, 2, 16, every_token // 2, 256)
    assert (k, v) == ("f16", "f16")
    size = pool_size(gemma, CacheConfig(16, 4096, cache_type_k="f16"), 2, 256)
    storage = PagedKVStorage(gemma, size.num_blocks, 16, "f16", torch.device("cpu"), None, size.window_layers,
                             size.num_window_blocks)
    assert context_pool_bytes(gemma, 4096, 2, 16, "f16", "f16", 256) == storage.nbytes < every_token // 2
    assert context_pool_bytes(gemma, 4096, 2, 16, "f16", "f16", 256, window_kv=False) == every_token


def test_nothing_fits_names_the_fixes():
    with pytest.raises(ValueError, match="lower --num-ctx or --max-num-seqs"):
        choose_cache_types(SMOLLM2, 2048, 4, 16, 1 * MiB)


def test_context_advice_gives_a_context_and_its_cost_per_type():
    advice = context_advice(SMOLLM2, 3000, "f16", "f16")
    assert "--num-ctx 4096" in advice
    # 4096 x 23,040 B; x 12,240 B
    assert "90.0 MiB with f16/f16" in advice and "47.8 MiB with q8_0/q8_0" in advice


def test_kv_cache_memory_auto_shrinks_to_the_budget_with_a_note(monkeypatch):
    from kvserve.plan import auto

    monkeypatch.setattr(auto, "memory_budget", lambda *a: (10 * MiB, "test budget"))
    picked = resolve_auto("smollm2", 8192, 1, 16, 512, "float32", "f16", "f16", "auto")
    assert picked.kv_cache_memory == 10 * MiB and "context shrinks" in picked.message
    both = resolve_auto("smollm2", 2048, 1, 16, 512, "float32", "auto", "auto", "auto")
    # tq4 (12.0 MiB) and tq4/tq3 (10.5 MiB) do not fit 10 MiB; tq3 (9.1 MiB) does
    assert (both.cache_type_k, both.cache_type_v) == ("tq3", "tq3")
    assert both.kv_cache_memory == pool_bytes(SMOLLM2, 2048, 1, 16, "tq3", "tq3")


@pytest.mark.slow
def test_cli_cache_type_auto_says_what_it_picked():
    r = subprocess.run([sys.executable, "-m", "kvserve", "run", "smollm2", "Hi", "--cache-type", "auto",
                        "--kv-cache-memory", "8MiB", "-c", "2048", "--max-tokens", "2", "--json"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert (record["cache_type_k"], record["cache_type_v"]) == ("tq2", "tq2")
    assert "--cache-type auto picked K tq2 / V tq2" in r.stderr


@pytest.mark.slow
def test_cli_prompt_too_long_names_the_fix():
    r = subprocess.run([sys.executable, "-m", "kvserve", "run", "smollm2", "word " * 400, "-c", "256"],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1
    assert "context limit is 256" in r.stderr and "use --num-ctx 1024" in r.stderr and "q8_0/q8_0" in r.stderr

"""The window group (Gemma 3's sliding layers) through the disk tier and prompt-cache files: a prompt
longer than the 512-token window, computed by one engine, is served by a fresh one almost whole from
disk or from a file (the window parts the next query reads come along), with the greedy tokens of an
engine that caches nothing (f32 KV). A window part that is missing or damaged only shortens the hit."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.hashing import window_part_hash
from kvserve.kv.prompt_cache import load_prompt_cache, read_prompt_cache, save_prompt_cache
from kvserve.models.loader import load_model
from kvserve.quality.text import default_text
from tests.support import make_engine

BLOCK = 16
PROMPT_TOKENS = 1200  # 75 blocks: a query after them reads blocks 43 .. 74 of the sliding layers
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(loaded, disk_cache_dir=None, prefix_caching=True):
    return make_engine(loaded, num_ctx=1536, max_num_seqs=1, budget=256, disk_cache_dir=disk_cache_dir,
                       prefix_caching=prefix_caching, window_kv=True)


def _run(engine, prompt, params=GREEDY):
    rid = engine.add_request(prompt, params).request_id
    return engine.run_to_completion()[rid]


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", weight_format="q4")


@pytest.fixture(scope="module")
def prompts(gemma):
    prompt = gemma.tokenizer.encode(default_text()[:8000])[:PROMPT_TOKENS]
    assert len(prompt) == PROMPT_TOKENS
    return prompt, prompt + gemma.tokenizer.encode(" In short,")


@pytest.fixture(scope="module")
def expected(gemma, prompts):
    """The continuation's greedy tokens, nothing cached."""
    return _run(_engine(gemma, prefix_caching=False), prompts[1]).token_ids


@dataclass
class Computed:
    root: Path  # disk/: the disk tier's directory; prompt.kvc: a prompt-cache file of the prompt
    files_written: int
    again: RequestOutput  # the continuation, by the same engine once other work took the window pool


@pytest.fixture(scope="module")
def computed(gemma, prompts, tmp_path_factory):
    """An engine computes the prompt with a disk tier, then another prompt that takes every block of the
    window pool, then saves the prompt's cache file and serves the continuation."""
    root = tmp_path_factory.mktemp("window_tiers")
    engine = _engine(gemma, disk_cache_dir=root / "disk")
    assert engine.kv.tied and engine.storage.windowed
    _run(engine, prompts[0], SamplingParams(temperature=0, max_tokens=1))
    engine.disk.flush()
    files_written = engine.disk.stats.blocks_written
    other = gemma.tokenizer.encode(default_text()[20000:26000])[: engine.kv.tied[0].pool.num_blocks * BLOCK]
    _run(engine, other, SamplingParams(temperature=0, max_tokens=1))
    assert save_prompt_cache(engine.cache, prompts[0], root / "prompt.kvc") == PROMPT_TOKENS
    again = _run(engine, prompts[1])
    engine.close()
    return Computed(root, files_written, again)


def test_every_computed_block_goes_to_disk_with_its_window_part(computed):
    assert computed.files_written == 2 * PROMPT_TOKENS // BLOCK


def test_a_window_taken_from_ram_comes_back_from_disk(prompts, expected, computed):
    assert computed.again.metrics.num_cached_tokens == PROMPT_TOKENS
    assert computed.again.token_ids == expected


def _copy_disk(computed, tmp_path):
    return shutil.copytree(computed.root / "disk", tmp_path / "disk")


def test_a_restart_serves_the_prompt_from_disk_with_its_window(gemma, prompts, expected, computed, tmp_path,
                                                                check_no_leaks):
    engine = _engine(gemma, disk_cache_dir=_copy_disk(computed, tmp_path))
    check_no_leaks.append(engine)
    out = _run(engine, prompts[1])
    assert out.metrics.num_cached_tokens == PROMPT_TOKENS > 0.9 * len(prompts[0])
    assert engine.kv.prefix_tier_hits == PROMPT_TOKENS
    window_parts_read = engine.disk.stats.blocks_read - PROMPT_TOKENS // BLOCK
    assert window_parts_read == PROMPT_TOKENS // BLOCK - engine.kv.tied[0].first_live(PROMPT_TOKENS)
    assert out.token_ids == expected
    engine.close()


def test_a_prompt_cache_file_carries_the_window(gemma, prompts, expected, computed, check_no_leaks):
    header, _ = read_prompt_cache(computed.root / "prompt.kvc")
    engine = _engine(gemma)
    last_window = range(engine.kv.tied[0].first_live(PROMPT_TOKENS), PROMPT_TOKENS // BLOCK)
    assert set(last_window) <= set(header["window_blocks"])
    check_no_leaks.append(engine)
    installed, _ = load_prompt_cache(engine.cache, computed.root / "prompt.kvc")
    assert installed == PROMPT_TOKENS
    out = _run(engine, prompts[1])
    assert out.metrics.num_cached_tokens == PROMPT_TOKENS
    assert out.token_ids == expected


def test_a_missing_or_damaged_window_part_only_shortens_the_hit(gemma, prompts, expected, computed, tmp_path,
                                                               check_no_leaks):
    engine = _engine(gemma, disk_cache_dir=_copy_disk(computed, tmp_path))
    check_no_leaks.append(engine)
    hashes = engine.kv.block_hashes_of(prompts[0])
    engine.disk.path(window_part_hash(hashes[70])).unlink()
    damaged = engine.disk.path(window_part_hash(hashes[60]))
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    out = _run(engine, prompts[1])
    assert out.metrics.num_cached_tokens == 60 * BLOCK  # the longest prefix whose window is all there
    assert engine.disk.stats.rejected_files == 1 and not damaged.exists()
    assert out.token_ids == expected
    engine.close()

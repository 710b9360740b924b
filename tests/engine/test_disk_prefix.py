"""The prefix cache's disk tier and prompt-cache files through the engine: a prefix served from RAM,
from disk or recomputed gives the same greedy tokens (f32 KV), blocks come back bit for bit in every
KV type, and processes sharing a directory neither corrupt it nor disagree on hashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.cache_types import KV_TYPES
from kvserve.kv.disk_tier import MAGIC
from kvserve.kv.file_framing import unpack
from kvserve.kv.prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache
from tests.support import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
REPO = Path(__file__).resolve().parents[2]


def _run(engine, prompt, params=GREEDY):
    rid = engine.add_request(prompt, params).request_id
    return engine.run_to_completion()[rid]


def _prompt(n: int, seed: int = 0, vocab: int = 90) -> list[int]:
    return [(i * 37 + seed * 11) % vocab + 3 for i in range(n)]


def _bits(out):
    return out.token_ids, [lp.logprob for lp in out.logprobs] if out.logprobs else None


def test_greedy_output_is_identical_from_ram_from_disk_and_recomputed(smollm2_q4, tmp_path, check_no_leaks):
    """SmolLM2 as served (q4 weights, native kernels): token ids and logprobs compared with ==."""
    smollm2 = smollm2_q4
    text = "The history of the printing press begins in the fifteenth century. " * 12
    prompt = smollm2.tokenizer.encode(text)
    recomputed = _run(make_engine(smollm2, prefix_caching=False), prompt)

    first = make_engine(smollm2, disk_cache_dir=tmp_path)
    check_no_leaks.append(first)
    cold = _run(first, prompt)
    from_ram = _run(first, prompt)
    first.close()
    assert cold.metrics.num_cached_tokens == 0 and from_ram.metrics.num_cached_tokens > 0

    second = make_engine(smollm2, disk_cache_dir=tmp_path)  # a restart: same directory, empty pool
    check_no_leaks.append(second)
    from_disk = _run(second, prompt)
    full_blocks = (len(prompt) - 1) // 16 * 16
    assert from_disk.metrics.num_cached_tokens == full_blocks
    assert second.kv.prefix_tier_hits == full_blocks and second.disk.stats.blocks_read == full_blocks // 16
    assert _bits(recomputed) == _bits(cold) == _bits(from_ram) == _bits(from_disk)
    second.close()


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_blocks_come_back_from_disk_bit_for_bit_in_every_kv_type(tiny_llama_hd64, tmp_path, kv_type):
    prompt = _prompt(80)
    a = make_engine(tiny_llama_hd64, cache_type_k=kv_type, disk_cache_dir=tmp_path)
    out_a = _run(a, prompt)
    stored = a.storage.export_blocks([b.block_id for b in a.kv.cached_prefix(prompt)])
    a.close()
    b = make_engine(tiny_llama_hd64, cache_type_k=kv_type, disk_cache_dir=tmp_path)
    blocks = b.kv.cached_prefix(prompt)  # loads them from disk
    assert len(blocks) == len(prompt) // 16 and b.disk.stats.blocks_read == len(blocks)
    assert np.array_equal(b.storage.export_blocks([x.block_id for x in blocks]), stored)
    assert _run(b, prompt).token_ids == out_a.token_ids
    files = list(tmp_path.rglob("*.kvb"))
    header, _ = unpack(files[0].read_bytes(), MAGIC, b.disk.secret)
    assert header["identity"]["layout"]["cache_type_k"] == kv_type  # stored in its own type
    b.close()


def test_damaged_files_are_recomputed_and_removed(tiny_llama, tmp_path, check_no_leaks):
    prompt = _prompt(100, seed=3)
    expected = _run(make_engine(tiny_llama, prefix_caching=False), prompt)
    a = make_engine(tiny_llama, disk_cache_dir=tmp_path)
    _run(a, prompt)
    a.close()
    hashes = a.kv.block_hashes_of(prompt)
    damaged = a.disk.path(hashes[2])
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))

    b = make_engine(tiny_llama, disk_cache_dir=tmp_path)
    check_no_leaks.append(b)
    out = _run(b, prompt)
    assert out.metrics.num_cached_tokens == 2 * 16  # the chain stops at the damaged block
    assert b.disk.stats.rejected_files == 1
    assert out.token_ids == expected.token_ids
    b.close()
    assert damaged.read_bytes() != bytes(data)  # removed, then written again whole from the recomputed block
    unpack(damaged.read_bytes(), MAGIC, b.disk.secret)


def test_other_setups_do_not_share_blocks(tiny_llama_hd64, tmp_path):
    prompt = _prompt(64)
    a = make_engine(tiny_llama_hd64, disk_cache_dir=tmp_path)
    _run(a, prompt)
    a.close()
    for other in ({"cache_type_k": "q8_0"}, {"block_size": 32}, {"disk_cache_dir": tmp_path / "elsewhere"}):
        b = make_engine(tiny_llama_hd64, **{"disk_cache_dir": tmp_path, **other})
        assert b.kv.block_hashes_of(prompt)[0] != a.kv.block_hashes_of(prompt)[0]
        assert _run(b, prompt).metrics.num_cached_tokens == 0
        b.close()
    same = make_engine(tiny_llama_hd64, disk_cache_dir=tmp_path)
    assert same.kv.block_hashes_of(prompt) == a.kv.block_hashes_of(prompt)
    same.close()


def test_preempted_requests_come_back_through_the_disk_tier(tiny_llama, tmp_path, check_no_leaks):
    prompts = [_prompt(70, seed=s) for s in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [_run(make_engine(tiny_llama, prefix_caching=False), p, params).token_ids for p in prompts]
    # 16 blocks: six requests of up to 7 blocks each cannot all run; cached blocks are evicted
    engine = make_engine(tiny_llama, kv_cache_memory=16 * 16 * tiny_llama.config.kv_size_per_token * 4,
                         disk_cache_dir=tmp_path)
    check_no_leaks.append(engine)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = engine.run_to_completion()
    assert engine.num_preemptions > 0
    assert [done[i].token_ids for i in ids] == expected
    again = [_run(engine, p, params) for p in prompts]  # evicted from RAM long ago: from disk now
    assert engine.kv.prefix_tier_hits > 0
    assert [o.token_ids for o in again] == expected
    engine.close()


def test_prompt_cache_file_round_trip_and_refusals(tiny_llama_hd64, tmp_path, check_no_leaks):
    prompt = _prompt(90, seed=5)
    a = make_engine(tiny_llama_hd64)
    out_a = _run(a, prompt)
    path = tmp_path / "s.kvc"
    saved = save_prompt_cache(a.cache, prompt + out_a.token_ids, path,
                              {"history": [{"role": "user", "content": "x"}]})
    assert saved == (len(prompt) + len(out_a.token_ids)) // 16 * 16

    b = make_engine(tiny_llama_hd64)
    check_no_leaks.append(b)
    tokens, extra = load_prompt_cache(b.cache, path)
    assert tokens == saved and extra["history"][0]["content"] == "x"
    out_b = _run(b, prompt)
    assert out_b.metrics.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert out_b.token_ids == out_a.token_ids

    with pytest.raises(PromptCacheError, match="layout"):
        load_prompt_cache(make_engine(tiny_llama_hd64, cache_type_k="q8_0").cache, path)
    with pytest.raises(PromptCacheError, match="prefix caching"):
        load_prompt_cache(make_engine(tiny_llama_hd64, prefix_caching=False).cache, path)
    damaged = bytearray(path.read_bytes())
    damaged[-40] ^= 1
    (tmp_path / "bad.kvc").write_bytes(bytes(damaged))
    with pytest.raises(PromptCacheError, match="CRC mismatch"):
        load_prompt_cache(b.cache, tmp_path / "bad.kvc")
    with pytest.raises(PromptCacheError, match="cannot read"):
        load_prompt_cache(b.cache, tmp_path / "missing.kvc")
    with pytest.raises(PromptCacheError, match="cached"):
        save_prompt_cache(make_engine(tiny_llama_hd64).cache, prompt, tmp_path / "none.kvc")


def test_a_prompt_cache_larger_than_the_pool_loads_what_fits(tiny_llama_hd64, tmp_path):
    prompt = _prompt(200, seed=6)
    a = make_engine(tiny_llama_hd64)
    _run(a, prompt)
    save_prompt_cache(a.cache, prompt, tmp_path / "s.kvc")
    per_block = 16 * tiny_llama_hd64.config.kv_size_per_token * 4
    small = make_engine(tiny_llama_hd64, kv_cache_memory=5 * per_block)
    tokens, _ = load_prompt_cache(small.cache, tmp_path / "s.kvc")
    assert tokens == 5 * 16


_WORKER = textwrap.dedent("""
    import json, sys
    from kvserve.models.loader import load_model
    from kvserve.engine.sampling_params import SamplingParams
    from tests.support import make_engine
    folder, disk, seeds, size = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    engine = make_engine(load_model(folder), disk_cache_dir=disk, disk_cache_size=size, num_ctx=256,
                         max_num_seqs=2)
    out = {}
    for seed in seeds:
        prompt = [(i * 37 + seed * 11) % 90 + 3 for i in range(96)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        rid = engine.add_request(prompt, params).request_id
        out[seed] = engine.run_to_completion()[rid].token_ids
    engine.close()
    print(json.dumps({"tokens": out, "tier_hits": engine.kv.prefix_tier_hits}))
""")


def test_processes_sharing_a_directory_agree_and_do_not_corrupt_it(tiny_llama, tmp_path):
    disk = tmp_path / "kv"
    expected = {}
    for seed in range(8):
        prompt = [(i * 37 + seed * 11) % 90 + 3 for i in range(96)]
        expected[str(seed)] = _run(make_engine(tiny_llama, prefix_caching=False), prompt,
                                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)).token_ids
    bound = 24 * 10_000  # tiny_llama: ~9.3 KB per block file, 48 distinct blocks written: evictions happen
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def start(seeds, size=bound):
        return subprocess.Popen([sys.executable, "-c", _WORKER, str(tiny_llama.path), str(disk),
                                 json.dumps(seeds), str(size)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env, text=True)

    workers = [start([0, 1, 2, 3, 4, 5, 6, 7]), start([7, 6, 5, 4, 3, 2, 1, 0])]  # overlapping, at once
    results = []
    for w in workers:
        stdout, stderr = w.communicate(timeout=300)
        assert w.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout))
    for r in results:
        assert r["tokens"] == {k: expected[k] for k in r["tokens"]}
    files = list(disk.rglob("*.kvb"))
    assert 0 < sum(f.stat().st_size for f in files) <= bound
    assert not list(disk.rglob("*.tmp"))
    secret = (disk / "secret").read_bytes()
    for f in files:
        unpack(f.read_bytes(), MAGIC, secret)  # every file whole and valid
    # a third process finds what the others left (with room of its own: its misses' writes would
    # otherwise evict, before it gets to them, the chains that survived)
    later = start(list(range(8)), size=10**9)
    stdout, stderr = later.communicate(timeout=300)
    assert later.returncode == 0, stderr[-3000:]
    assert json.loads(stdout)["tier_hits"] > 0

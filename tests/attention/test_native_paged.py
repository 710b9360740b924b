"""The C attention kernels (decode and prefill) against the torch path over the same stored blocks,
every KV type; their invariances (batch, threads, chunking) bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.config import ModelConfig
from kvserve.kv.codecs import RotatedKeys
from kvserve.kv.storage import PagedKVStorage
from tests.attention.paged_cases import (
    BLOCK,
    NUM_BLOCKS,
    config,
    decode,
    filled_storage,
    prefill,
    prefill_int_keys,
)

pytestmark = pytest.mark.skipif(native.load("paged_attention") is None,
                                reason="no C compiler on this machine")


# q8_0 and q4_0 keys are scored in integers in prefill where the build has AVX-512 VNNI (the kernel says so):
# the query rounded to int16 (at most 1/65534 of its largest element) is the one difference from the f32
# arithmetic.
INT_KEY_TYPES = ("q8_0", "q4_0")
INT_KEYS = prefill_int_keys()


@pytest.mark.parametrize("cache_type", list(native_paged.KV_KIND_CODES))
def test_matches_torch_path_for_every_kv_type(cache_type):
    cfg = config()
    lens = [1, 17, 255, 256, 257, 700]  # around the 256-position partitions and 16-token blocks
    storage, tables = filled_storage(cfg, cache_type, lens)
    q = torch.randn(len(lens), cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(1))
    for layer, window in ((0, None), (1, 100)):
        ours = decode(storage, tables, lens, q, layer, window, True)
        reference = decode(storage, tables, lens, q, layer, window, False)
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache_type", ["f16", *INT_KEY_TYPES])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block"), [
    (8, 1, 128, 16),  # a group of 8: value sums eight heads a sweep (four with AVX-512)
    (14, 2, 64, 16),  # Qwen2.5's groups of 7
    (4, 1, 256, 32),  # Gemma 3's shape; blocks of 32 rows score as two groups of 16
    (3, 3, 96, 8),    # no grouping; a head dim that is not a multiple of 64; blocks of 8 rows
])
def test_decode_matches_torch_path_for_other_head_shapes_and_block_sizes(
    cache_type, heads, kv_heads, head_dim,
                                                                          block):
    cfg = config(heads, kv_heads, head_dim)
    lens = [1, 17, 255, 300]
    storage, tables = filled_storage(cfg, cache_type, lens, block=block)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(2))
    for layer, window in ((0, None), (1, 37)):
        ours = decode(storage, tables, lens, q, layer, window, True)
        reference = decode(storage, tables, lens, q, layer, window, False)
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)
    chunk = torch.randn(90, heads, head_dim, generator=torch.Generator().manual_seed(3))  # prefill: 210..299
    for layer, window in ((0, None), (1, 37)):
        ours = prefill(storage, tables[3], 300, chunk, layer, window, True)
        reference = prefill(storage, tables[3], 300, chunk, layer, window, False)
        if INT_KEYS and cache_type in INT_KEY_TYPES:
            assert 1e-6 < (ours - reference).abs().max() < 2e-4
        else:  # sums over 256 elements in another order than torch's: a few 1e-6 apart
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


# decoded in registers, or into a buffer (tq4)
@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0", "f16", "tq4"])
def test_a_sequence_gives_the_same_bits_alone_and_in_a_batch(cache_type):
    cfg = config(heads=9, kv_heads=3)
    lens = [300, 5, 1030, 64]
    storage, tables = filled_storage(cfg, cache_type, lens, seed=3)
    q = torch.randn(len(lens), cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(4))
    batched = decode(storage, tables, lens, q, 0, None, True)
    for i in range(len(lens)):
        alone = decode(storage, [tables[i]], [lens[i]], q[i : i + 1], 0, None, True)
        assert torch.equal(alone[0], batched[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode(storage, tables, lens, q, 0, None, True), batched)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache_type", ["f16", "f32", "q4_0", "tq4"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2), (4, 4), (14, 2)])
def test_speculative_rows_attended_together_give_the_bits_of_each_alone(cache_type, heads, kv_heads):
    """A request's verify rows (its context one longer each, over the same blocks) and requests sharing a
    prefix are attended together, each block read once for all of them; each row must get its own bits."""
    cfg = config(heads=heads, kv_heads=kv_heads)
    storage, (table, other) = filled_storage(cfg, cache_type, [700, 300], seed=7)
    kernel = native_paged.for_storage(storage)
    # a short row; two of the same length over other blocks; four rows of a request that shares the
    # first's blocks (a cached prefix); nine rows of one request across the 512-position partition edge
    lens = [12, 300, 300, 290, 291, 292, 293] + [505 + i for i in range(9)]
    rows = [table, table, other] + [table] * 13
    width = max(len(t) for t in rows)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in rows])
    q = torch.randn(len(lens), heads, cfg.head_dim, generator=torch.Generator().manual_seed(8))
    for layer, window, softcap in ((0, None, None), (1, 100, None), (0, 260, 20.0)):
        together = kernel.decode(layer, q, tables, torch.tensor(lens), window, 0.125, softcap)
        for i in range(len(lens)):
            alone = kernel.decode(layer, q[i : i + 1], tables[i : i + 1], torch.tensor(lens[i : i + 1]),
                                  window, 0.125, softcap)
            assert torch.equal(alone[0], together[i]), (layer, window, i)


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0"])  # q4_0's rows are scored in lane order
# groups of 3, 6 and 7 (Qwen2.5's): up to 8 heads a sweep, one to four rows beside them
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (12, 2), (14, 2)])
def test_rows_decoded_in_registers_give_the_bits_of_the_same_values_stored_as_f32(
        cache_type, heads, kv_heads):
    """These rows are decoded as they are loaded and scored several query heads a sweep; f32 rows (and a
    block's partial rows, decoded into the buffer) as the sweeps of each path take them. Each score is
    the same FMA chain, each value sum too."""
    cfg = config(heads=heads, kv_heads=kv_heads)
    lens = [300, 5, 1030, 64]
    storage, tables = filled_storage(cfg, cache_type, lens, seed=5)
    exact = PagedKVStorage(cfg, NUM_BLOCKS, BLOCK, "f32", torch.device("cpu"))
    if storage.k_codec.rotated:  # q8_0 keys are stored rotated: the f32 copy is scored with the same query
        exact.k_codec = RotatedKeys(exact.k_codec)
    every_block = storage.block_rows(torch.arange(NUM_BLOCKS)[None])
    for layer in range(cfg.num_layers):
        for stored, decoded in zip((exact.k[layer][0], exact.v[layer][0]),
                                   storage.read_blocks(layer, every_block, torch.float32), strict=True):
            stored.copy_(decoded.view(stored.shape))
    q = torch.randn(len(lens), cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(6))
    for layer, window in ((0, None), (1, 100)):  # the window starts inside a block: partial rows
        assert torch.equal(decode(storage, tables, lens, q, layer, window, True),
                           decode(exact, tables, lens, q, layer, window, True))


@pytest.mark.parametrize("cache_type", list(native_paged.KV_KIND_CODES))
def test_prefill_matches_torch_path_for_every_kv_type(cache_type):
    """A whole prompt and a later chunk (queries from position 200), causal and windowed."""
    cfg = config()
    storage, tables = filled_storage(cfg, cache_type, [333])
    q = torch.randn(333, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(1))
    int_keys = INT_KEYS and cache_type in INT_KEY_TYPES
    for layer, window in ((0, None), (1, 100)):
        for chunk in (q, q[200:]):
            ours = prefill(storage, tables[0], 333, chunk, layer, window, True)
            reference = prefill(storage, tables[0], 333, chunk, layer, window, False)
            if int_keys:  # the int16 query's error, and proof that the integer path ran
                assert 1e-6 < (ours - reference).abs().max() < 2e-4
            else:
                torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cache_type", ["f32", *INT_KEY_TYPES])
def test_prefill_gives_the_same_bits_whole_or_in_chunks(cache_type):
    """Chunks that cut through query tiles and KV blocks; one thread = two."""
    cfg = config(heads=9, kv_heads=3)
    storage, tables = filled_storage(cfg, cache_type, [531], seed=6)
    q = torch.randn(531, cfg.num_heads, cfg.head_dim, generator=torch.Generator().manual_seed(7))
    for window in (None, 70):
        whole = prefill(storage, tables[0], 531, q, 0, window, True)
        cuts = [0, 5, 37, 256, 300, 531]
        for a, b in itertools.pairwise(cuts):
            assert torch.equal(prefill(storage, tables[0], b, q[a:b], 0, window, True), whole[a:b]), (a, b)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(prefill(storage, tables[0], 531, q, 0, window, True), whole)
        finally:
            torch.set_num_threads(threads)


def test_without_a_compiler_the_torch_path_stays(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(native, "PREBUILT_DIR", tmp_path / "no-prebuilt")
    native.load.cache_clear()
    try:
        assert native.load("paged_attention") is None
    finally:
        native.load.cache_clear()


def test_a_broken_build_falls_back_with_the_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS",
                        [*native.FLAGS, "-DPAGED_DECODE_FAIL", "-include", "missing-header.h"])
    native.load.cache_clear()
    try:
        assert native.load("paged_attention") is None
        assert "missing-header.h" in caplog.text
    finally:
        native.load.cache_clear()


def test_a_shared_header_is_part_of_the_cache_key(monkeypatch, tmp_path):
    """Editing a header rebuilds the kernels that include it (the key hashes the directory's headers)."""
    source_dir = tmp_path / "native"
    source_dir.mkdir()
    (source_dir / "probe.c").write_text('#include "shared.h"\nint value(void) { return VALUE; }\n')
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "SOURCE_DIR", source_dir)
    values = []
    try:
        for value in (1, 2):
            (source_dir / "shared.h").write_text(f"#define VALUE {value}\n")
            native.load.cache_clear()
            values.append(native.load("probe").value())
    finally:
        native.load.cache_clear()
    assert values == [1, 2]


def written_both_ways(cache_type: str, cfg: ModelConfig, tokens: int = 77):
    """The parts of layer 1 after the same k/v went through the C writer and through the codec's torch
    encode; and the k/v. Keys span five decades of magnitude; values come as bf16 (as q4 weights give)."""
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=g)[:tokens]
    k = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, generator=g) * torch.logspace(-3, 2, cfg.head_dim)
    v = torch.randn(tokens, cfg.num_kv_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
    stored = []
    for use_native in (True, False):
        storage = PagedKVStorage(cfg, NUM_BLOCKS, BLOCK, cache_type, torch.device("cpu"))
        write = native_paged.writer_for_storage(storage) if use_native else storage.write
        assert isinstance(write, native_paged.NativeKVWrite) == use_native
        write(1, storage.slot_rows(slots), k, v)
        stored.append(([p.clone() for p in storage.k[1]], [p.clone() for p in storage.v[1]]))
    return stored, slots, storage, k, v


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "q8_0", "q4_0", "fp8"])
def test_the_c_writer_stores_the_codecs_own_codes(cache_type):
    """Every part of the storage written by the C writer equals what the codec's torch encode stores
    (fp8 has no C writer: its fallback must give the same)."""
    (ours, theirs), _, storage, _, _ = written_both_ways(cache_type, config())
    exact = ours[1] + theirs[1] if storage.k_codec.rotated else ours[0] + ours[1] + theirs[0] + theirs[1]
    half = len(exact) // 2
    for a, b in zip(exact[:half], exact[half:], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_the_c_writer_rotates_block_keys_as_the_codec_does(cache_type):
    """q8_0/q4_0 keys are rotated before their codes (codecs.RotatedKeys): the C writer's rotation sums in
    another order than torch's matmul, so a value within rounding of a code boundary (or a group's largest
    value, its scale) may land on either side. Decoded, the two agree within one code step; nearly every
    code is the same."""
    (ours, theirs), slots, storage, _, _ = written_both_ways(cache_type, config())
    assert storage.k_codec.rotated
    rows = storage.slot_rows(slots)
    decoded = [storage.k_codec.decode([p.view(-1, p.shape[-1])[rows] for p in parts], torch.float32)
               for parts in (ours[0], theirs[0])]
    # a code step per element: its group's scale (either writer's, whichever is larger)
    scales = [parts[1].view(-1, parts[1].shape[-1])[rows].float().abs() for parts in (ours[0], theirs[0])]
    step = torch.maximum(*scales).repeat_interleave(32, -1)
    assert ((decoded[0] - decoded[1]).abs() <= step * 1.1).all()
    codes = [parts[0].view(-1, parts[0].shape[-1])[rows] for parts in (ours[0], theirs[0])]
    assert (codes[0] == codes[1]).float().mean() > 0.99


@pytest.mark.parametrize("cache_type", ["tq2", "tq3", "tq4"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_c_writer_encodes_rotated_codecs_as_the_codec_does(cache_type, head_dim):
    """tq codes from the C writer equal the torch encode's, except coordinates whose rotated value lies
    within rounding of a bucket edge (there the two rotations' sums, in different orders, may fall on
    either side: then the codes are neighbours); the stored norms agree to one f16 step."""
    from kvserve.kv.codecs import unpack_bits

    cfg = config(heads=2, kv_heads=2, head_dim=head_dim)
    (ours, theirs), slots, storage, k, v = written_both_ways(cache_type, cfg)
    rows = storage.slot_rows(slots)
    for parts_ours, parts_theirs, codec, x in ((ours[0], theirs[0], storage.k_codec, k),
                                               (ours[1], theirs[1], storage.v_codec, v)):
        codes = [unpack_bits(p[0].view(-1, p[0].shape[-1])[rows], codec.bits,
                             head_dim).int() for p in (parts_ours, parts_theirs)]
        y = x.double().transpose(0, 1).flatten(0, 1) @ codec.matrix.double()  # head-major, as rows
        unit = y / y.norm(dim=-1, keepdim=True)
        cb = torch.from_numpy(codec.codebook).double()
        near_edge = ((unit.unsqueeze(-1) - (cb[1:] + cb[:-1]) / 2).abs() < 1e-5).any(-1)
        differ = codes[0] != codes[1]
        assert not (differ & ~near_edge).any()
        assert ((codes[0] - codes[1]).abs()[differ] == 1).all()
        assert differ.float().mean() < 1e-3  # a few coordinates at most
        norms = [p[1].view(-1)[rows].float() for p in (parts_ours, parts_theirs)]
        same_codes = ~differ.any(-1)
        assert same_codes.float().mean() > 0.9
        torch.testing.assert_close(norms[0][same_codes], norms[1][same_codes], rtol=1e-3, atol=0)

"""The host-memory arena: tensors laid out in one buffer are zeroed, aligned, disjoint and keep their
shapes; big buffers start on a 2 MiB page; the KV pool and the packed weights live in arenas; the freed
heap is handed back through the C library's malloc_trim."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvserve.host_memory import HUGE_PAGE, arena, empty_bytes, rehome

CPU = torch.device("cpu")


def test_arena_tensors_are_zeroed_aligned_disjoint_views_of_one_buffer():
    specs = [((3, 5), torch.float16), ((7,), torch.int8), ((2, 2, 3), torch.float32), ((1,), torch.uint8)]
    tensors = arena(specs, CPU)
    assert [(tuple(t.shape), t.dtype) for t in tensors] == specs
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 and not t.any() for t in tensors)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one buffer
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [int(t.flatten()[0]) for t in tensors] == [1, 2, 3, 4]  # no tensor wrote over another
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazily zeroed mapping is Linux's")
def test_a_big_arena_is_zero_without_being_touched_first():
    """A pool-sized arena comes from a fresh anonymous mapping: zero everywhere, 2 MiB-aligned, and its
    pages resident only once written (the start-up pays no memset of the whole pool)."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10

    before = rss()
    (big,) = arena([((64 << 20,), torch.uint8)], CPU)
    assert big.data_ptr() % HUGE_PAGE == 0 and rss() - before < (16 << 20)  # 64 MiB asked, not touched
    assert not big[:: 4096].any() and not big[-1]  # zero wherever it is read (each read faults one page)
    big[: 1 << 20].fill_(7)
    assert int(big[(1 << 20) - 1]) == 7 and int(big[1 << 20]) == 0


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line
    raise LookupError(hex(address))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazily zeroed mapping is Linux's")
def test_a_big_arena_is_private_memory_not_shmem():
    """Python's mmap maps shared by default: shmem, counted and reclaimed apart from the process's memory
    (and never given huge pages by default), which the pool's docstring did not mean."""
    (big,) = arena([((8 << 20,), torch.uint8)], CPU)
    permissions = _mapping_of(big.data_ptr()).split()[1]
    assert permissions == "rw-p", permissions


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_big_buffers_start_on_a_huge_page_and_small_ones_stay_plain():
    assert empty_bytes(HUGE_PAGE + 123, CPU).data_ptr() % HUGE_PAGE == 0
    assert empty_bytes(4096, CPU).numel() == 4096


def test_rehome_moves_each_owners_array_into_one_arena_exactly():
    rng = np.random.default_rng(0)
    originals = [rng.standard_normal((300, 7), dtype=np.float32),
                 rng.integers(-128, 127, 1 << 21, dtype=np.int8)]
    owners = [SimpleNamespace(packed=a) for a in originals]
    rehome(owners, "packed")
    copies = [o.packed for o in owners]
    assert all(a.dtype == b.dtype and np.array_equal(a, b) and a.ctypes.data != b.ctypes.data
               for a, b in zip(originals, copies, strict=True))
    assert copies[0].base is not None and copies[0].base is copies[1].base  # views of one buffer
    assert copies[1].ctypes.data - copies[0].ctypes.data == 300 * 7 * 4 + 48  # packed, cache-line aligned
    if sys.platform.startswith("linux"):  # together over 2 MiB: the arena starts on a huge page
        assert copies[0].ctypes.data % HUGE_PAGE == 0


def test_kv_pool_is_one_arena():
    from kvserve.config import ModelConfig
    from kvserve.kv.storage import PagedKVStorage

    cfg = ModelConfig(architecture="llama", num_layers=3, hidden_size=64, intermediate_size=8, num_heads=2,
                      num_kv_heads=1, head_dim=32, vocab_size=8, max_position_embeddings=256)
    storage = PagedKVStorage(cfg, 8, 16, "q8_0", CPU, "f16")
    arrays = [a for layer in storage.k_arrays + storage.v_arrays for a in layer]
    assert len(arrays) == 3 * (2 + 1)  # q8_0 keys: codes and scales; f16 values: codes
    assert len({id(a.base) for a in arrays}) == 1  # views of one buffer
    assert all(a.flags.c_contiguous and a.ctypes.data % 64 == 0 and not a.any() for a in arrays)
    assert storage.k_arrays[0][0].shape == (1, 8, 16, 32) and storage.k_arrays[0][1].dtype == np.float16
    # the torch path's tensors are views of the same memory, with the codec's types
    tensors = [p for layer in storage.k + storage.v for p in layer]
    assert [t.data_ptr() for t in tensors] == [a.ctypes.data for a in arrays]
    assert storage.k[0][0].dtype == torch.int8 and storage.k[0][1].dtype == torch.float16


class FakeTrim:
    """Stands for glibc's malloc_trim: records the argument and the ctypes signature it was called with."""

    def __init__(self, calls: list) -> None:
        self.calls, self.argtypes, self.restype = calls, None, None

    def __call__(self, pad: int) -> int:
        self.calls.append((pad, self.argtypes, self.restype))
        return 1


def test_release_freed_memory_asks_the_c_library_to_trim_its_heap(monkeypatch):
    """Our part of giving the freed heap back: malloc_trim(0) from the process's own C library, with its
    C signature (what the OS then reclaims is the machine's: bench/load_memory.py measures it)."""
    import ctypes

    from kvserve import host_memory

    opened, calls = [], []

    def cdll(name):
        opened.append(name)
        return SimpleNamespace(malloc_trim=FakeTrim(calls))

    monkeypatch.setattr(host_memory.ctypes, "CDLL", cdll)
    host_memory.release_freed_memory()
    assert opened == [None]
    assert calls == [(0, [ctypes.c_size_t], ctypes.c_int)]


@pytest.mark.parametrize("libc", ["missing", "without malloc_trim"])
def test_release_freed_memory_is_a_no_op_without_malloc_trim(monkeypatch, libc):
    from kvserve import host_memory

    def cdll(name):
        if libc == "missing":
            raise OSError("no C library")
        return SimpleNamespace()

    monkeypatch.setattr(host_memory.ctypes, "CDLL", cdll)
    host_memory.release_freed_memory()  # returns quietly


def test_packing_arena_hands_out_aligned_disjoint_slices_then_falls_back():
    from kvserve.host_memory import packed_bytes, packing_arena

    with packing_arena(3 << 20) as arena:
        a, b = packed_bytes(1000), packed_bytes(HUGE_PAGE)
        assert arena.holds(a) and arena.holds(b) and b.ctypes.data - a.ctypes.data == 1024  # cache lines
        assert a.ctypes.data % HUGE_PAGE == 0 and not a.any() and not b.any()
        big = packed_bytes(2 * HUGE_PAGE)  # does not fit what is left: ordinary memory, same size
        assert not arena.holds(big) and big.size == 2 * HUGE_PAGE
        a.fill(1)
        assert int(b[0]) == 0
        owners = [SimpleNamespace(packed=a), SimpleNamespace(packed=big)]
        rehome(owners, "packed")  # only what the arena does not hold moves
        assert owners[0].packed.ctypes.data == a.ctypes.data
        assert owners[1].packed.ctypes.data != big.ctypes.data
    outside = packed_bytes(1000)
    assert not arena.holds(outside)

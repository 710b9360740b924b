"""The host-memory arena: tensors laid out in one buffer are zeroed, aligned, disjoint and keep their
shapes; big buffers start on a 2 MiB page; the KV pool and the packed weights live in arenas."""

from __future__ import annotations

import sys

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked for on Linux only")
def test_big_buffers_start_on_a_huge_page_and_small_ones_stay_plain():
    assert empty_bytes(HUGE_PAGE + 123, CPU).data_ptr() % HUGE_PAGE == 0
    assert empty_bytes(4096, CPU).numel() == 4096


def test_rehome_moves_each_owners_tensor_into_one_arena_exactly():
    from types import SimpleNamespace

    originals = [torch.randn(300, 7), torch.randint(-128, 127, (1 << 21,), dtype=torch.int8)]
    owners = [SimpleNamespace(packed=t) for t in originals]
    rehome(owners, "packed")
    copies = [o.packed for o in owners]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(originals, copies))
    assert copies[0].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr()
    if sys.platform.startswith("linux"):  # together over 2 MiB: the arena starts on a huge page
        assert copies[0].data_ptr() % HUGE_PAGE == 0


def test_kv_pool_is_one_arena():
    from kvserve.config import ModelConfig
    from kvserve.kv.storage import PagedKVStorage

    cfg = ModelConfig(architecture="llama", num_layers=3, hidden_size=64, intermediate_size=8, num_heads=2,
                      num_kv_heads=1, head_dim=32, vocab_size=8, max_position_embeddings=256)
    storage = PagedKVStorage(cfg, 8, 16, "q8_0", CPU, "f16")
    parts = [p for layer in storage.k + storage.v for p in layer]
    assert len(parts) == 3 * (2 + 1)  # q8_0 keys: codes and scales; f16 values: codes
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1
    assert all(p.is_contiguous() and not p.any() for p in parts)
    assert storage.k[0][0].shape == (1, 8, 16, 32) and storage.k[0][1].dtype == torch.float16


FREED_HEAP = """
import torch
from kvserve.host_memory import release_freed_memory

def resident_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) >> 10

big = torch.ones(4 << 20)  # 16 MiB: freed, it lifts glibc's mmap threshold (up to 32 MiB)
del big
before = resident_mib()
blocks = [(torch.ones(1 << 18), torch.ones(4)) for _ in range(300)]  # 300 x 1 MiB from the heap, each
pins = [small for _, small in blocks]  # followed by a small live block, so the heap's top cannot shrink
del blocks
kept = resident_mib() - before
release_freed_memory()
print(kept, resident_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc are Linux's")
def test_freed_heap_memory_goes_back_to_the_os():
    """In a fresh process: after a big free the 1 MiB tensors come from the heap, and with live blocks
    between them (as a load leaves the model's own tensors) their 300 MiB stay resident once freed, until
    release_freed_memory (as the dequantized weights did after a load)."""
    import subprocess

    runs = []
    for _ in range(3):  # the OS may reclaim some idle pages by itself (a CI run once kept fewer than 200 MiB)
        r = subprocess.run([sys.executable, "-c", FREED_HEAP], capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode == 0, r.stderr
        kept, after = map(int, r.stdout.split())
        runs.append((kept, after))
        if kept > 200:
            break
    if kept <= 200:  # seen in fresh-clone CI runs: the process kept 12 of the 300 MiB, three times in a row
        pytest.skip(f"not run: the freed heap went back to the OS by itself here, nothing left for "
                    f"release_freed_memory (MiB kept, MiB after, per run: {runs})")
    assert after < 50, f"(MiB kept after the free, MiB after release_freed_memory) per run: {runs}"

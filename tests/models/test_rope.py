"""RoPE in place through ``native/rope.c``: the same bits as ``apply_rotary`` on the rotated heads,
the other heads untouched, and torch's copy (the input left as it was) where the kernel does not
apply."""

from __future__ import annotations

import pytest
import torch

from kvserve import native
from kvserve.models.rope import RotaryEmbedding, apply_rotary, rotate_heads

pytestmark = pytest.mark.skipif(native.load("rope") is None, reason="no C compiler on this machine")


def tables(head_dim: int, positions: torch.Tensor):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return RotaryEmbedding(inv_freq, torch.device("cpu"), torch.float32).tables(
        positions, int(positions.max()))


@pytest.mark.parametrize("tokens, head_dim", [(1, 64), (9, 64), (130, 256)])  # 130: the threaded loop
def test_same_bits_as_apply_rotary_and_the_values_untouched(tokens, head_dim):
    g = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 5000, (tokens,), generator=g)
    cos, sin = tables(head_dim, positions)
    qkv = torch.randn(tokens, 9 + 3 + 3, head_dim, generator=g) * 10
    expected = apply_rotary(qkv[:, :12], cos, sin)
    x = qkv.clone()
    assert rotate_heads(x, 12, cos, sin) is x  # the kernel ran, in place
    assert torch.equal(x[:, :12], expected)
    assert torch.equal(x[:, 12:], qkv[:, 12:])


def test_refuses_what_the_kernel_does_not_take():
    positions = torch.arange(4)
    cos, sin = tables(64, positions)
    for x in (torch.randn(4, 6, 64).to(torch.bfloat16), torch.randn(6, 4, 64).transpose(0, 1)):
        before = x.clone()
        assert rotate_heads(x, 4, cos, sin) is not x  # torch's copy instead
        assert torch.equal(x, before)


def test_tables_grow_to_the_served_context_with_the_same_values():
    """Doubling stops at the served context (fit_context), and building the tables a chunk of positions
    at a time gives each position the values of the whole-table float64 math."""
    import torch

    from kvserve.models.rope import ROPE_CHUNK, RotaryEmbedding

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 256, 2, dtype=torch.float64) / 256))
    rope = RotaryEmbedding(inv_freq, torch.device("cpu"), torch.float32)
    rope.fit_context(ROPE_CHUNK + 1000)
    rope.tables(torch.tensor([5]), 300)
    rope.tables(torch.tensor([5]), ROPE_CHUNK + 999)
    assert rope.cos.shape == (ROPE_CHUNK + 1000, 256)  # not doubled to 2 x 512 ... past the context
    freqs = torch.outer(torch.arange(ROPE_CHUNK + 1000, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[:, :128].neg_()
    assert torch.equal(rope.cos, emb.cos().float()) and torch.equal(rope.sin, sin.float())
    rope.tables(torch.tensor([5]), ROPE_CHUNK + 5000)  # a position past it still gets its row
    assert rope.cos.shape[0] == ROPE_CHUNK + 5001


@pytest.mark.parametrize("served", [None, 1000])
def test_tables_grown_in_steps_are_the_tables_built_at_once(served):
    """Rows filled a step at a time in the served context's buffer (or doubled past it) hold the same bits
    as one table built for every position at once, and never more rows than the served context."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    grown, whole = RotaryEmbedding(inv_freq, torch.device("cpu"), torch.float32), None
    if served is not None:
        grown.fit_context(served)
    buffers = set()
    for last in (3, 255, 256, 700, 999):
        positions = torch.arange(0, last + 1)
        cos, sin = grown.tables(positions, last)
        assert grown.cos.shape[0] <= (served or 10**9)
        buffers.add(id(grown._buffers[0]))
        whole = RotaryEmbedding(inv_freq, torch.device("cpu"), torch.float32)
        whole._grow(last + 1)
        assert torch.equal(cos, whole.cos[: last + 1].unsqueeze(1)) and torch.equal(
            sin, whole.sin[: last + 1].unsqueeze(1))
    if served is not None:
        assert len(buffers) == 1  # one buffer of the served context, filled in place, never copied
        assert grown.cos.data_ptr() == grown._buffers[0].ctypes.data

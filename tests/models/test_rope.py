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
    return RotaryEmbedding(inv_freq, torch.device("cpu"), torch.float32).tables(positions, int(positions.max()))


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

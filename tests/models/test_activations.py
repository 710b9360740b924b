"""The MLP gate through ``native/silu_mul.c``: SiLU(gate) * up within float rounding of torch's formula,
a row the same bits alone and batched, and torch's formula itself where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import native
from kvserve.models import activations
from kvserve.models.activations import gated

pytestmark = pytest.mark.skipif(native.load("silu_mul") is None, reason="no C compiler on this machine")


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 40), (300, 1536)])  # 40: a tail past 16 lanes
def test_silu_gate_matches_torch_and_rows_are_batch_invariant(rows, inter):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-4, 0.0, 1e-4, 30.0, 100.0, -0.5])
    ours = gated(gate_up, "silu")
    torch.testing.assert_close(ours, reference(gate_up), rtol=1e-6, atol=1e-30)
    for r in (0, rows - 1):
        assert torch.equal(gated(gate_up[r : r + 1], "silu"), ours[r : r + 1])


def test_the_kernel_runs_where_it_applies(monkeypatch):
    calls = []
    real = activations._silu_mul_kernel()
    monkeypatch.setattr(activations, "_silu_mul_kernel", lambda: lambda *args: calls.append(args) or real(*args))
    gated(torch.randn(3, 64), "silu")
    assert len(calls) == 1


def test_torch_formula_where_the_kernel_does_not_apply():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    assert torch.equal(gated(x.to(torch.bfloat16), "silu"), reference(x.to(torch.bfloat16)))
    wide = torch.randn(64, 5, generator=g).t()  # not contiguous
    assert torch.equal(gated(wide, "silu"), reference(wide))
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(gated(x, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)

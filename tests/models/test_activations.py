"""The MLP gate through ``native/silu_mul.c`` (SwiGLU) and ``native/gelu_mul.c`` (GeGLU, GELU's tanh
form): act(gate) * up within float rounding of torch's formula, a row the same bits alone and batched,
and torch's formula itself where the kernels do not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import native
from kvserve.models import activations
from kvserve.models.activations import gated

pytestmark = pytest.mark.skipif(native.load("silu_mul") is None, reason="no C compiler on this machine")

TORCH_ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def reference(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return TORCH_ACT[act](gate) * up


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 40), (300, 1536)])  # 40: a tail past 16 lanes
def test_gate_matches_torch_and_rows_are_batch_invariant(act, rows, inter):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-4, 0.0, 1e-4, 30.0, 100.0, -0.5])
    ours = gated(gate_up, act)
    # against float64, relative to the value (a few f32 roundings), with an absolute floor far below anything
    # a model sees for GELU's tail, x e^-1.6|x|^3 (torch's own f32 GELU is off by 100% there: 1 + tanh
    # cancels)
    torch.testing.assert_close(ours, reference(gate_up.double(), act).float(), rtol=4e-6, atol=1e-10)
    for r in (0, rows - 1):
        assert torch.equal(gated(gate_up[r : r + 1], act), ours[r : r + 1])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_the_kernel_runs_where_it_applies(monkeypatch, act):
    calls = []
    real = activations.gate_kernel(act)
    assert real is not None
    monkeypatch.setattr(activations, "gate_kernel",
                        lambda name: lambda *args: calls.append(args) or real(*args))
    gated(torch.randn(3, 64), act)
    assert len(calls) == 1


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_torch_formula_where_the_kernel_does_not_apply(act):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    assert torch.equal(gated(x.to(torch.bfloat16), act), reference(x.to(torch.bfloat16), act))
    wide = torch.randn(64, 5, generator=g).t()  # not contiguous
    assert torch.equal(gated(wide, act), reference(wide, act))

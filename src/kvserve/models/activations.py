"""The MLP's gate: act(gate) * up from the fused gate_up projection's output.

SwiGLU (SiLU) runs through ``native/silu_mul.c`` and GeGLU (GELU's tanh form: Gemma) through
``native/gelu_mul.c`` on CPU: one pass instead of a chunk, an activation and a multiply (three
dispatches a layer and a temporary), and the arithmetic the one-call decode step runs. Other
devices and dtypes, and machines without the kernels, go through torch.
"""

from __future__ import annotations

from functools import cache

from kvserve import native
from kvserve.lazy_torch import F, torch

GATE_KERNELS = {"silu": ("silu_mul", "silu_mul"), "gelu_tanh": ("gelu_mul", "gelu_tanh_mul")}


@cache  # looked up once a layer: one cache hit
def gate_kernel(act: str):
    return native.function(*GATE_KERNELS[act]) if act in GATE_KERNELS else None


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [n, 2 * inter] (gate, then up) -> act(gate) * up [n, inter]; act "silu" or "gelu_tanh"."""
    kernel = gate_kernel(act) if gate_up.device.type == "cpu" else None
    if kernel is not None and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
        n, width = gate_up.shape
        out = torch.empty(n, width // 2, dtype=gate_up.dtype)
        kernel(gate_up.data_ptr(), n, width // 2, out.data_ptr())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up

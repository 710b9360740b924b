"""The MLP's gate: act(gate) * up from the fused gate_up projection's output.

SwiGLU (SiLU) runs through ``native/silu_mul.c`` on CPU: one pass instead of a chunk, a silu and a
multiply (three dispatches a layer and a temporary). GELU (Gemma), other devices and dtypes, and
machines without the kernel go through torch.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from kvserve import native


@cache  # looked up once a layer: one cache hit without arguments
def _silu_mul_kernel():
    return native.function("silu_mul", "silu_mul")


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [n, 2 * inter] (gate, then up) -> act(gate) * up [n, inter]; act "silu" or "gelu_tanh"."""
    kernel = _silu_mul_kernel() if act == "silu" and gate_up.device.type == "cpu" else None
    if kernel is not None and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
        n, width = gate_up.shape
        out = torch.empty(n, width // 2, dtype=gate_up.dtype)
        kernel(gate_up.data_ptr(), n, width // 2, out.data_ptr())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up

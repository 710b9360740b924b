"""RMSNorm, the residual add fused in front of it, and per-head q/k norms, through ``native/rms_norm.c``
on CPU.

torch's CPU ``rms_norm`` costs ~40 us a call at one token (61 calls a SmolLM2 decode step, ~2.5 ms);
the C version does the arithmetic only. Any tensor the kernel does not take (another device, a
dtype other than f32, a non-contiguous view) goes through torch instead, with the same math.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from kvserve import native
from kvserve.lazy_torch import F, torch


@cache  # looked up on every call (~120 a decode step): one cache hit without arguments
def _rms_norm_kernel():
    return native.function("rms_norm", "rms_norm")


@cache
def _add_rms_norm_kernel():
    return native.function("rms_norm", "add_rms_norm")


@cache
def _rms_norm_heads_kernel():
    return native.function("rms_norm", "rms_norm_heads")


def _native_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.is_contiguous() and weight.is_contiguous() and _rms_norm_kernel() is not None)


def _tensor(weight: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A norm's weight as a tensor: the CPU runtime holds them as numpy arrays (a view, no copy)."""
    return torch.from_numpy(weight) if isinstance(weight, np.ndarray) else weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor | np.ndarray, eps: float) -> torch.Tensor:
    """Normalizes over the last dimension."""
    weight = _tensor(weight)
    if x.dtype != weight.dtype:  # a bf16 projection output (q4 weights) is normalized in f32
        x = x.to(weight.dtype)
    hidden = x.shape[-1]
    if not _native_ok(x, weight):
        return F.rms_norm(x, (hidden,), weight, eps)
    out = torch.empty_like(x)
    _rms_norm_kernel()(x.data_ptr(), weight.data_ptr(), eps, x.numel() // hidden, hidden, out.data_ptr())
    return out


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | np.ndarray, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)). x [n, hidden] f32 is updated in place where the kernel runs: callers
    pass a residual stream they own."""
    weight = _tensor(weight)
    native_h = h.dtype in (torch.float32, torch.bfloat16) and h.is_contiguous() and h.shape == x.shape
    if not (native_h and _native_ok(x, weight)):
        x = x + h
        return x, rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    _add_rms_norm_kernel()(x.data_ptr(), h.data_ptr(), int(h.dtype == torch.bfloat16), weight.data_ptr(), eps,
                           x.numel() // hidden, hidden, out.data_ptr())
    return x, out


def rms_norm_heads(x: torch.Tensor, first: int, count: int, weight: torch.Tensor | np.ndarray,
                   eps: float) -> torch.Tensor:
    """Heads [first, first + count) of x [num_tokens, total_heads, head_dim] normalized (per head vector,
    ``weight`` [head_dim]): in place through the kernel where it runs (the arithmetic of ``rms_norm``'s
    rows, so a head's result never depends on the batch or on which path ran), else into a copy."""
    weight = _tensor(weight)
    n, total, d = x.shape
    kernel = _rms_norm_heads_kernel()
    if _native_ok(x, weight) and kernel is not None:
        kernel(x.data_ptr() + 4 * first * d, n, count, total * d, d, weight.data_ptr(), eps)
        return x
    x = x.clone()
    x[:, first : first + count] = F.rms_norm(x[:, first : first + count], (d,), weight.to(x.dtype), eps)
    return x

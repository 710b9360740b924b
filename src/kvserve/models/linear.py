"""Weight formats for the model's matrix multiplies.

    f32    dense float32 weights: the reference, every exactness test runs on it
    bf16   dense bfloat16 weights (activations cast to bf16 for the matmul, the residual stream stays
           f32): half the bytes read per decode step.
    int8   int8 weights with an f16 scale per group of 32 inputs (``Int8GroupLinear``): a Q8_0, Q5_0 or
           Q4_0 tensor's own codes and scales; or with an f32 scale and offset per 16 inputs: a Q6_K
           tensor's (found from its values), a Q4_K, Q5_K, Q4_1 or Q5_1 tensor's (the file's grid,
           ``gguf_file.GRID_DECODERS``), all the gguf library's dequantization bit for bit; any other
           tensor rounded to Q8_0's grid; each activation one int16 code (two int8 digits joined), so
           the product is exact integer arithmetic and only the weights' rounding matters. Where the C
           kernel cannot be built, one scale per output row through torch (``Int8Linear``).
    q4     a GGUF's matrices in their file's bits (``Int4Linear.from_blocks``, ``Int8GroupLinear`` for
           Q8_0, ``StackedLinear`` for stacks of several types: models/file_linears.py); through f32 (an
           HF model, the types without a layout) 4-bit grids as 4-bit groups, the rest as int8 groups.
           ``native/int4_matmul.c`` takes f32 activations as two int8 digits, exact integer group sums;
           torch's int4 CPU kernel (bf16 activations) where it cannot be built.
    q4-fast  q4 with llama.cpp's activations in the 4- to 6-bit projections: one int8 code per
           activation, a scale per group of 32 (half the integer products of q4); the int8 groups as q4's.
           Faster where the products bound the time (batches, prefill); KLD against f32 between q4's
           (~1e-6) and llama.cpp's own on the same file (models/weight_choice.py: when auto takes it).

Each format computes every row of a batch exactly as it would alone (per-row activation scales,
integer accumulation), so batched, chunked and single-token runs agree bit for bit within a format.
Rejected after measurement: int8 with one int8 digit per token (SmolLM2's activation outliers) and
fbgemm dynamic quantization (per-tensor activation scales: a row's result would depend on its batch).
The measured KLD of each format is in docs/kernels.md (*Weight formats*).

A projection is a callable ``x [num_tokens, in] -> [num_tokens, out]``; the model does not care which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from kvserve import native
from kvserve.host_memory import host_array, rehome
from kvserve.lazy_torch import Device, F, as_numpy, is_tensor, torch, torch_dtype
from kvserve.models import block_layouts
from kvserve.models.layouts import GGUF_LAYOUTS, QL_F16, QL_F32
from kvserve.models.weight_grids import (
    INT4_GROUP,
    ROW_BLOCK,
    int4_grid_from16,
    int4_groups,
    int8_groups,
    int8_groups16,
    pack_int4,
    pack_int8_groups,
    pack_int8_groups16,
    pack_int8_groups_by_rows,
    unpack_int4,
)

# config.WEIGHT_CHOICES adds "auto", resolved by the loader
WEIGHT_FORMATS = ("f32", "bf16", "int8", "q4", "q4-fast")
# The exact integer format, whose logits are f32's within KLD 1e-6; "auto" picks it or q4-fast
# (llama.cpp's activations) by the CPU and the file: models/weight_choice.py.
CPU_GGUF_FORMAT = "q4"


class Linear(Protocol):
    nbytes: int  # bytes of weights one call reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear:
    """f32 weights are stored as W^T ([in, out], contiguous): a decode step's GEMV then streams memory
    in the order the kernel reads it (decode 1.36x faster on SmolLM2 than with [out, in]). bf16 keeps
    [out, in], where torch's bf16 kernel is the faster one (measured both ways)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.transposed = dtype == torch.float32
        w = weight.to(dtype)
        self.stored = w.t().contiguous() if self.transposed else w
        self.bias = None if bias is None else bias.to(dtype)
        self.dtype = dtype
        self.nbytes = self.stored.numel() * self.stored.element_size()

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], as torch.nn.Linear holds it."""
        return self.stored.t() if self.transposed else self.stored

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(self.dtype)
        if not self.transposed:
            return F.linear(x, self.stored, self.bias).to(in_dtype)
        y = x @ self.stored
        return (y if self.bias is None else y + self.bias).to(in_dtype)


class Int8Linear:
    """W [out, in] as int8 with a scale per output row. Per token, u = x * 127 / max|x| is split
    into two int8 digits q1 = round(u), q2 = round((u - q1) * 254); one integer matmul of the stacked
    digits gives both partial products, and y = (Y1 + Y2 / 254) * max|x| / 127 * row_scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.float()
        self.row_scale = (w.abs().amax(1) / 127).clamp_min(1e-30)
        self.q = (w / self.row_scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.bias = None if bias is None else bias.float()
        self.nbytes = self.q.numel() + 4 * self.row_scale.numel()

    @property
    def weight(self) -> torch.Tensor:
        return self.q.float() * self.row_scale[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        m = x.shape[0]
        amax = x.abs().amax(1, keepdim=True).float().clamp_min_(1e-30)
        u = x * (127 / amax)
        q1 = u.round()
        digits = torch.cat([q1, u.sub_(q1).mul_(254).round_()]).to(torch.int8)
        y2 = torch._int_mm(digits, self.q.t()).float()
        y = torch.add(y2[:m], y2[m:], alpha=1 / 254).mul_(amax * (1 / 127)).mul_(self.row_scale)
        return (y if self.bias is None else y + self.bias).to(in_dtype)


class Int8GroupLinear(Int8Linear):
    """The output head and every projection that is not a 4-bit grid, through ``native/int8_matmul.c``:
    int8 weights with an f16 scale per group of 32 inputs (``int8_groups``: a Q8_0, Q5_0 or Q4_0 tensor
    held exactly, so SmolLM2's Q8_0 head is), 16-row panels streamed once per
    8 activation rows. Each activation is one int16 code (two int8 digits joined); a group's products
    are an exact integer sum (AVX-512 VNNI). So only the activations round (~1e-5 of the output):
    SmolLM2's KLD ~1e-6, where one weight scale per row (re-rounding the Q8_0 grid) cost 0.0016.
    SmolLM2's 30 MB head: ~1 ms a step at one row (bandwidth), ~3 ms at 16. Each row's logits are the
    same bits alone or batched. Where the kernel cannot be built, ``Int8Linear``'s path (one scale per
    row)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None,
        grid16: Callable[[], tuple[torch.Tensor, ...] | None] | tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """grid16: (codes, scales, offsets) of a grid the file states (GGUF Q4_K), or a function making it,
        held as given where no f16 grid per 32 holds the tensor exactly."""
        self.kernel = _int8_matmul_kernel()
        if self.kernel is None:
            super().__init__(weight, bias)
            return
        self.out_features, self.in_features = weight.shape
        self.bias = host_vector(bias)
        groups = int8_groups(weight, exact=True)  # the smaller layout wherever it holds the tensor exactly
        if groups is None:  # the file's grid, else one found from the values: f32 scales (offsets) per 16
            grid16 = (grid16() if callable(grid16) else grid16) or int8_groups16(weight)
        if groups is None and grid16 is not None:
            self.layout, self.kernel = "g16", _int8_matmul_kernel("int8_matmul_g16")
            self.packed = host_array(pack_int8_groups16(*grid16))
        else:  # f16 scales per 32: a Q8_0/Q5_0/Q4_0 grid, or any tensor rounded to Q8_0's
            self.layout = "g32"
            self.packed = host_array(pack_int8_groups(*(groups or int8_groups(weight))))
        self.nbytes = self.packed.nbytes

    @staticmethod
    def native() -> bool:
        """Whether the C kernel runs here (``from_packed`` and ``from_grid32`` need it)."""
        return _int8_matmul_kernel() is not None

    @classmethod
    def from_packed(cls, rows: int, cols: int, packed: np.ndarray | torch.Tensor,
                    bias: np.ndarray | torch.Tensor | None = None) -> Int8GroupLinear:
        """Around weights already in the g32 layout (``file_linears.int8_groups`` repacks a file's blocks
        into it). Needs the kernel."""
        lin = cls.__new__(cls)
        lin.kernel, lin.layout = _int8_matmul_kernel(), "g32"
        lin.out_features, lin.in_features = rows, cols
        lin.bias = host_vector(bias)
        lin.packed = host_array(packed)
        lin.nbytes = lin.packed.nbytes
        return lin

    @classmethod
    def from_grid32(cls, rows: int, cols: int, chunks,
                    bias: np.ndarray | torch.Tensor | None = None) -> Int8GroupLinear:
        """Straight from a Q8_0 / Q5_0 / Q4_0 grid (``gguf_file.symmetric_grid``: its size and chunks of
        int8 codes with their f32 scales per 32), never through f32 weights: the reference the tests hold
        ``file_linears.int8_groups``' native repack to. Needs the kernel."""
        lin = cls.__new__(cls)
        lin.kernel, lin.layout = _int8_matmul_kernel(), "g32"
        lin.out_features, lin.in_features = rows, cols
        lin.bias = host_vector(bias)
        lin.packed = host_array(pack_int8_groups_by_rows(rows, cols, chunks, huge_pages=True))
        lin.nbytes = lin.packed.nbytes
        return lin

    @property
    def weight(self) -> torch.Tensor:
        return super().weight if self.kernel is None else self.rows(torch.arange(self.out_features))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return super().__call__(x)
        return _run_matmul(self.kernel, x, (self.packed,), self.bias, self.out_features).to(x.dtype)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``self(x)`` written into ``out`` (f32 [tokens, out_features], rows of unit stride)."""
        if self.kernel is None:
            out.copy_(self(x))
        else:
            _run_matmul(self.kernel, x, (self.packed,), self.bias, self.out_features, out=out)

    def rows(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Weight rows ``ids`` as f32 [len(ids), in] (into out when given, f32 and contiguous): each code
        times its group's scale, a tied model's embedding lookup (only where the kernel holds them)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.in_features) if out is None else out
        rows = _int8_rows_kernel("int8_rows_g16" if self.layout == "g16" else "int8_rows")
        rows(self.packed.ctypes.data, ids.data_ptr(), ids.shape[0], self.in_features, out.data_ptr())
        return out

    def weight_array(self) -> np.ndarray:
        """``weight`` in numpy: every row through the kernel, without torch."""
        if self.kernel is None:
            return self.weight.numpy()
        out = np.empty((self.out_features, self.in_features), dtype=np.float32)
        ids = np.arange(self.out_features, dtype=np.int64)
        rows = _int8_rows_kernel("int8_rows_g16" if self.layout == "g16" else "int8_rows")
        rows(self.packed.ctypes.data, ids.ctypes.data, len(ids), self.in_features, out.ctypes.data)
        return out

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether ``rows`` gives ``weight`` back exactly (a Q8_0 tensor does), by blocks of rows."""
        if self.kernel is None or tuple(weight.shape) != (self.out_features, self.in_features):
            return False
        n = weight.shape[0]
        return all(torch.equal(self.rows(torch.arange(r, min(r + ROW_BLOCK, n))),
                               weight[r : r + ROW_BLOCK].float())
                   for r in range(0, n, ROW_BLOCK))


def _int8_rows_kernel(name: str = "int8_rows"):
    return native.function("int8_matmul", name)


def _int8_matmul_kernel(name: str = "int8_matmul"):
    return native.function("int8_matmul", name)


class Int4Linear:
    """Codes of 4, 5 or 6 bits with the file's scales (``native/int4_matmul.c``'s layouts, kernels.h's
    ``QL_*``): 4-bit groups with a scale and an offset per 32 inputs (Q4_1's grid with f16 ones, any
    4-bit grid with f32 ones), or a GGUF tensor's own blocks (``from_blocks``: Q4_0, Q4_1, Q5_0, Q5_1,
    Q4_K, Q5_K, Q6_K at their file's bytes per weight). f32 activations split per token into two int8
    digits, exact integer group sums, f32 group scaling: relative output error ~5e-5, where torch's int4
    CPU kernel (bf16 activations) gives ~3e-3. ``fast``: one int8 code per activation with a scale per
    group of 32 (llama.cpp's q8 activations), half the integer products, relative output error ~5e-3.
    Where the kernel cannot be built, torch's kernel for 4-bit groups (its convention
    w = (q - 8) * scale + zero, so zero = lo + 8 * scale; returns bf16); ``from_blocks`` needs the kernel."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bias: torch.Tensor | None,
        fast: bool = False,
    ) -> None:
        self.out_features, self.in_features = codes.shape
        self.digits = 1 if fast else 2
        self.bias = host_vector(bias)
        self.kernel = _int4_matmul_kernel()
        # f32 where f16 cannot hold a scale or offset exactly: 20% more bytes
        f32_scales = not all(torch.equal(t, t.half().float()) for t in (scale, lo))
        self.layout = QL_F32 if f32_scales else QL_F16
        if self.kernel is not None:
            self.packed = host_array(pack_int4(codes, scale, lo, f32_scales))
            self.nbytes = self.packed.nbytes
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        zero = lo + 8 * scale
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.nbytes = self.packed.numel() + self.scales_zeros.numel() * 2

    @classmethod
    def from_blocks(cls, raw, type_name: str, rows: int, cols: int,
                    bias: np.ndarray | torch.Tensor | None = None,
                    fast: bool = False, on_rows: Callable[[int], None] | None = None) -> Int4Linear:
        """A GGUF tensor straight from its file bytes (``block_layouts.pack_blocks``, which tells ``on_rows``
        of its progress), never through f32 weights. Needs the kernel (``native()``)."""
        lin = cls.__new__(cls)
        lin.kernel = _int4_matmul_kernel()
        lin.out_features, lin.in_features, lin.digits = rows, cols, 1 if fast else 2
        lin.bias = host_vector(bias)
        lin.layout = GGUF_LAYOUTS[type_name][0]
        lin.packed = block_layouts.pack_blocks(raw, type_name, rows, cols, on_rows=on_rows)
        lin.nbytes = lin.packed.nbytes
        return lin

    @staticmethod
    def native() -> bool:
        """Whether the C kernel runs here (``from_blocks`` needs it)."""
        return _int4_matmul_kernel() is not None

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] f32: scale * code + offset per group, as the file's dequantization rounds it."""
        return torch.from_numpy(self.weight_array())

    def weight_array(self) -> np.ndarray:
        """``weight`` in numpy (unpacked without torch)."""
        if self.layout not in (QL_F16, QL_F32):
            return block_layouts.unpack_weight(self.packed, self.layout, self.out_features, self.in_features)
        packed = self.packed.reshape(self.packed.shape[0], self.in_features // INT4_GROUP, -1)
        codes, scale, lo = unpack_int4(packed, self.out_features, self.layout == QL_F32)
        groups = codes.reshape(self.out_features, -1, INT4_GROUP).astype(np.float32) * scale[..., None]
        return (groups + lo[..., None]).reshape(self.out_features, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            x = x.to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)
            return y if self.bias is None else y + torch.from_numpy(self.bias)
        return _run_matmul(self.kernel, x, (self.packed,), self.bias, self.out_features,
                           (self.digits, self.layout))

    def into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``self(x)`` written into ``out`` (f32 [tokens, out_features], rows of unit stride)."""
        if self.kernel is None:
            out.copy_(self(x))
        else:
            _run_matmul(self.kernel, x, (self.packed,), self.bias, self.out_features,
                        (self.digits, self.layout), out)


class StackedLinear:
    """Projections stacked by output rows (q, k, v; gate, up) whose parts a file holds in different
    layouts (a Q6_K or Q8_0 v beside Q4_K or Q5_0 q and k): each part's kernel writes its own columns of
    one output (the kernels' row stride), so every part keeps its file's bits and the stack costs no copy.
    Each column is the same bits as its part alone."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.nbytes = sum(p.nbytes for p in parts)
        self.bias = None  # each part adds its own

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([p.weight for p in self.parts])

    def weight_array(self) -> np.ndarray:
        return np.concatenate([weight_array(p) for p in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.into(x, y)
        return y.to(x.dtype)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        first = 0
        for part in self.parts:
            part.into(x, out[:, first : first + part.out_features])
            first += part.out_features


def _int4_matmul_kernel():
    return native.function("int4_matmul", "int4_matmul")


def _run_matmul(
    kernel, x: torch.Tensor, weights: tuple, bias: np.ndarray | torch.Tensor | None, out_features: int,
    options: tuple = (), out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [tokens, out] f32 = kernel(x, *weights, bias, M, N, K, y, threads, *options, ldy), the calling
    convention of ``native/int4_matmul.c`` and ``native/int8_matmul.c``; into ``out`` where given (f32,
    rows of unit stride: a stacked projection's columns)."""
    xf = x.float().contiguous()
    m, k = xf.shape
    y = torch.empty(m, out_features, dtype=torch.float32) if out is None else out
    addresses = (host_array(w).ctypes.data for w in weights)
    rc = kernel(xf.data_ptr(), *addresses, bias_address(bias), m, out_features, k,
                y.data_ptr(), native.num_threads(), *options, y.stride(0))
    if rc != 0:
        raise MemoryError("native matmul: could not allocate the activation digits")
    return y


def weight_array(linear) -> np.ndarray | None:
    """A projection's weights [out, in] as f32 numpy (without torch for the kernels' layouts), or None for
    one that has none to show."""
    method = getattr(linear, "weight_array", None)
    if method is not None:
        return method()
    weight = getattr(linear, "weight", None)
    return None if weight is None else as_numpy(weight).astype(np.float32)


def host_vector(v: np.ndarray | torch.Tensor | None) -> np.ndarray | None:
    """A bias for the C kernels: f32, contiguous numpy (a tensor is copied to the host)."""
    return None if v is None else np.ascontiguousarray(as_numpy(v), dtype=np.float32)


def bias_address(bias: np.ndarray | torch.Tensor | None) -> int:
    """What the kernels take for a bias (f32, contiguous): its address, or 0 for none."""
    if bias is None:
        return 0
    return bias.data_ptr() if is_tensor(bias) else bias.ctypes.data


def pack_into_arena(linears: list) -> None:
    """The C kernels' packed weights of ``linears`` moved into one arena (``kvserve.host_memory``: 2 MiB
    pages on a Linux CPU), so a decode step streams them with a TLB entry per 2 MiB, not per 4 KiB."""
    flat = [part for lin in linears for part in getattr(lin, "parts", [lin])]
    owners = [lin for lin in flat if getattr(lin, "kernel", None) is not None
              and isinstance(getattr(lin, "packed", None), np.ndarray)]
    rehome(owners, "packed")


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, device: Device, dtype: str | torch.dtype,
    grid16: Callable[[], tuple[torch.Tensor, ...] | None] | tuple[torch.Tensor, ...] | None = None,
) -> Linear:
    """``fmt``'s projection: 4-bit groups for a tensor that is a 4-bit grid already (q4, q4-fast), int8
    groups for every other (q4, q4-fast, int8), dense floats for f32 and bf16. grid16: the file's own grid
    of ``weight`` where its values do not tell it, made when called (``Int8GroupLinear``)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    weight = weight.to(device)
    bias = None if bias is None else torch.as_tensor(bias).to(device)
    if fmt in ("int8", "q4", "q4-fast") and device.type != "cpu":
        raise ValueError(
            f"--weights {fmt} uses torch's CPU integer kernels; use f32 or bf16 on {device.type}"
        )
    if fmt in ("q4", "q4-fast") and weight.shape[1] % INT4_GROUP == 0:
        groups = int4_groups(weight)
        if groups is None and grid16 is not None and _int4_matmul_kernel() is not None:
            grid16 = grid16()  # decoded once: the int8 groups take it where it is no 4-bit grid
            groups = None if grid16 is None else int4_grid_from16(grid16)
        if groups is not None:
            return Int4Linear(*groups, bias, fast=fmt == "q4-fast")
    if fmt in ("int8", "q4", "q4-fast"):
        return Int8GroupLinear(weight, bias, grid16)
    return DenseLinear(weight, bias, torch.bfloat16 if fmt == "bf16" else torch_dtype(dtype))

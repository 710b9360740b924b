"""The grids the integer weight formats hold (models/linear.py's formats): finding a tensor's grid from
its values (GGUF's symmetric per-32 grids, Q6_K's per-16 one, Q4_1's 4-bit one) or taking the file's
(``GGUFWeights.grid16``, ``gguf_file.symmetric_grid``), and packing codes and scales into the layouts the C
kernels read (``native/int4_matmul.c``, ``native/int8_matmul.c``). Plain tensor arithmetic; no kernel is
called here.
"""

from __future__ import annotations

import numpy as np

from kvserve.host_memory import empty_bytes
from kvserve.lazy_torch import F, torch

INT4_GROUP = 32
ROW_BLOCK = 4096  # rows converted at a time: f32 temporaries of a few MiB, not of a whole tensor


# The symmetric GGUF grids, w = d * c with d f16 per group of 32, by the largest |code| their quantizers
# give the group's largest |w|: Q8_0 (codes -127..127), Q5_0 (-16..15), Q4_0 (-8..7).
SYMMETRIC_GRIDS = (127, 16, 8)


def int8_groups(weight: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """int8 codes with an f16 scale per group of 32 inputs (inputs zero-padded to a multiple of 32):
    w = d * q. A group that is one of SYMMETRIC_GRIDS (a Q8_0, Q5_0 or Q4_0 tensor's) comes back exactly,
    with its own scale and codes; any other is rounded to Q8_0's grid, d = max|w| / 127 in f16 (with
    ``exact``: None instead). Returns (q int8 [out, in32], d f32 [out, groups])."""
    n, k = weight.shape
    groups = -(-k // INT4_GROUP)
    q, d = torch.empty(n, groups * INT4_GROUP, dtype=torch.int8), torch.empty(n, groups)
    for r in range(0, n, ROW_BLOCK):  # the whole head at once made ~250 MiB of temporaries
        padded = F.pad(weight[r : r + ROW_BLOCK].float(), (0, -k % INT4_GROUP)).view(-1, INT4_GROUP)
        amax = padded.abs().amax(-1)
        dr = (amax / 127).clamp_max(65504).half().float()
        if fit_grid_scales(padded, amax, dr, SYMMETRIC_GRIDS, f16=True) and exact:
            return None
        d[r : r + ROW_BLOCK] = dr.view(-1, groups)
        codes = (padded / dr[:, None]).nan_to_num_(0.0, 0.0, 0.0).round_().clamp_(-127, 127)
        q[r : r + ROW_BLOCK] = codes.view(-1, groups * INT4_GROUP).to(torch.int8)
    return q, d


def int8_groups16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A symmetric grid with an f32 scale per 16 inputs (GGUF Q6_K's d * sc, codes -32..31; Q8_0, Q5_0 and
    Q4_0 too), found from the values: per group, the scale max|w| / c for the first largest |code| c of
    127, 32, 31, ..., 1 that gives every weight back exactly. Returns (codes int8 [out, in32], scales,
    offsets (zero) f32 [out, in32 / 16]), or None when some group is no such grid (or the inputs are
    not a multiple of 32)."""
    n, k = weight.shape
    if k % INT4_GROUP:
        return None
    codes, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 16)
    for r in range(0, n, ROW_BLOCK):
        g = weight[r : r + ROW_BLOCK].float().reshape(-1, 16)
        amax = g.abs().amax(-1)
        scale = torch.zeros_like(amax)
        if fit_grid_scales(g, amax, scale, (127, *range(32, 0, -1)), f16=False):  # Q8_0's, then Q6_K's codes
            return None
        scales[r : r + ROW_BLOCK] = scale.view(-1, k // 16)
        codes[r : r + ROW_BLOCK] = (g / scale[:, None]).nan_to_num_(0.0, 0.0, 0.0).round_().view(
            -1, k).to(torch.int8)
    return codes, scales, torch.zeros_like(scales)


def pack_int8_groups16(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in32], f32 scales and offsets [out, in32 / 16] -> u8 [ceil(out / 16), groups, 768],
    ``native/int8_matmul.c``'s GROUPS_16 layout: per panel of 16 outputs and group of 32 inputs, the 16
    scales of inputs 0-15, of 16-31, the offsets likewise (f32), then the codes as pack_int8_groups'."""
    n, k = q.shape
    panels, groups = -(-n // 16), k // INT4_GROUP
    pad = (0, 0, 0, panels * 16 - n)
    codes = F.pad(q, pad).view(panels, 16, groups, 16, 2).permute(0, 2, 3, 1, 4).reshape(panels, groups, 512)

    # [out, groups * 2] -> [panels, groups, 2 halves x 16 lanes] bytes
    def halves(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t.float(), pad).view(panels, 16, groups, 2).permute(0, 2, 3, 1).contiguous()
        return t.view(panels, groups, 32).view(torch.uint8)

    return torch.cat([halves(scales), halves(offsets), codes.view(torch.uint8)], -1).contiguous()


def fit_grid_scales(groups: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, largest_codes,
                    f16: bool) -> int:
    """For each group [num_groups, size] whose largest |w| is amax: the scale amax / c for the first c of
    ``largest_codes`` that holds the group exactly (exact_grid_scale), written into ``scale``. Returns how
    many nonzero groups none of them holds (their ``scale`` entries left as they were)."""
    todo = (amax > 0).nonzero().squeeze(1)
    for largest in largest_codes:
        if todo.numel() == 0:
            break
        candidate = amax[todo] / largest
        fits = exact_grid_scale(groups[todo], candidate, f16)
        scale[todo[fits]] = candidate[fits]
        todo = todo[~fits]
    return todo.numel()


def exact_grid_scale(groups: torch.Tensor, scale: torch.Tensor, f16: bool) -> torch.Tensor:
    """Per group [..., size]: whether ``scale`` (with ``f16``, an f16 value) times integer codes in
    -127..127 gives every weight back."""
    codes = (groups / scale[..., None]).nan_to_num_(0.0, 0.0, 0.0).round_()
    fits = (scale > 0) & (codes * scale[..., None] == groups).all(-1) & (codes.abs() <= 127).all(-1)
    return fits & (scale == scale.half().float()) if f16 else fits


def pack_int8_groups(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in32] and group scales [out, groups] -> u8 [ceil(out / 16), groups, 544], the
    layout ``native/int8_matmul.c`` reads: per panel of 16 outputs and group of 32 inputs, the 16
    scales (f16), then 16 pairs of 32 bytes, byte 2 * lane + i = input 2 * pair + i of output lane.
    Outputs padded to a multiple of 16 with zeros."""
    n, k = q.shape
    return pack_int8_groups_by_rows(n, k,
                                    (
                                        (r, q[r : r + ROW_BLOCK], d[r : r + ROW_BLOCK]) for r in range(
                                            0, n, ROW_BLOCK)))


def pack_int8_groups_by_rows(n: int, k: int, chunks, huge_pages: bool = False) -> torch.Tensor:
    """pack_int8_groups from (first row, codes, scales) chunks whose first rows are multiples of 16, each
    packed into the output as it comes: a head's temporaries are a chunk's, not copies of the tensor.
    huge_pages: the output in its own 2 MiB-page buffer (``host_memory.empty_bytes``), where
    ``pack_into_arena`` would put it, without a second copy of it at the load's peak."""
    panels, groups = -(-n // 16), k // INT4_GROUP
    shape = (panels, groups, 32 + 512)
    out = (empty_bytes(panels * groups * 544, torch.device("cpu")).view(shape) if huge_pages
           else torch.empty(shape, dtype=torch.uint8))
    for r, qr, dr in chunks:
        rows = qr.shape[0]
        p = -(-rows // 16)
        qr = F.pad(qr, (0, 0, 0, p * 16 - rows)).view(p, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)
        scales = F.pad(dr, (0, 0, 0, p * 16 - rows)).half().view(p, 16, groups).transpose(1, 2)
        block = out[r // 16 : r // 16 + p]
        block[..., :32] = scales.contiguous().view(torch.uint8)
        block[..., 32:] = qr.reshape(p, groups, 512).view(torch.uint8)
    return out


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Asymmetric 4-bit codes per group of 32 along the input: w ~ lo + scale * q, q in 0..15, with
    scale and lo rounded to f16 (as GGUF's Q4_1 stores them). Returns (codes uint8 [out, in], scale,
    lo [out, groups]) when every weight is recovered (the tensor was 4-bit in its file), else None.
    By blocks of rows, stopping at the first that is not exact: f32 temporaries of a few MiB, not
    several of the whole tensor (SmolLM2's Q8_0 head cost ~340 MiB at load)."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.uint8)
    scale, lo = torch.empty(n, k // INT4_GROUP), torch.empty(n, k // INT4_GROUP)
    for r in range(0, n, ROW_BLOCK):
        g = weight[r : r + ROW_BLOCK].float().view(-1, k // INT4_GROUP, INT4_GROUP)
        low, high = g.amin(-1), g.amax(-1)
        s = ((high - low) / 15).clamp_min(1e-7).half().float()
        low = low.half().float()
        q = ((g - low[..., None]) / s[..., None]).round_().clamp_(0, 15)
        err = (q * s[..., None] + low[..., None] - g).abs().amax(-1)
        if not (
            bool((err <= 1e-3 * s).all()) and bool(torch.isfinite(low).all() and torch.isfinite(s).all())
        ):
            return None
        codes[r : r + ROW_BLOCK], scale[r : r + ROW_BLOCK], lo[r : r + ROW_BLOCK] = q.view(
            -1, k).to(torch.uint8), s, low
    return codes, scale, lo


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
              f32_scales: bool = False) -> torch.Tensor:
    """The layout ``native/int4_matmul.c`` reads: per panel of 16 outputs and group of 32 inputs,
    320 bytes = 256 of codes (chunk c: k-quads 2c and 2c + 1 as low and high nibbles, byte
    4 * lane + i = output lane's code at k = 4 * quad + i) + 16 f16 scales + 16 f16 offsets; with
    ``f32_scales`` 384 bytes, the scales and offsets as f32. Outputs are padded to a multiple of 16 with
    zero weights."""
    n, k = codes.shape
    panels, groups = -(-n // 16), k // INT4_GROUP
    pad = panels * 16 - n
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scale, lo = (torch.cat([t, t.new_zeros(pad, groups)]) for t in (scale, lo))
    # P G chunk half lane i
    q = codes.to(torch.uint8).view(panels, 16, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(panels, groups, 256)

    def halves(t: torch.Tensor) -> torch.Tensor:
        t = t.float() if f32_scales else t.half()
        return t.view(panels, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nibbles, halves(scale), halves(lo)], -1).contiguous()


def unpack_int4(packed: np.ndarray, n: int, f32_scales: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pack_int4's inverse, in numpy: packed uint8 [panels, groups, bytes] -> (codes uint8 [n, in], scale,
    lo f32 [n, groups])."""
    panels, groups, _ = packed.shape
    nibbles = packed[..., :256].reshape(panels, groups, 4, 16, 4)  # P G chunk lane i
    q = np.stack([nibbles & 0x0F, nibbles >> 4], 3)  # P G chunk half lane i
    codes = q.transpose(0, 4, 1, 2, 3, 5).reshape(panels * 16, groups * INT4_GROUP)[:n]
    width = 64 if f32_scales else 32

    def part(start: int) -> np.ndarray:
        raw = np.ascontiguousarray(packed[..., start : start + width]).view(
            np.float32 if f32_scales else np.float16)
        return raw.reshape(panels, groups, 16).transpose(0, 2, 1).reshape(panels * 16, groups)[:n].astype(
            np.float32)

    return codes, part(256), part(256 + width)


def int4_grid_from16(grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[
    torch.Tensor, ...] | None:
    """A file's grid per 16 inputs (``GGUFWeights.grid16``) as 4-bit groups of 32, where it is one: codes
    0..15 and each 32 inputs' two halves sharing their scale and offset (GGUF Q4_K, Q4_1). Returns
    (codes uint8, scale, lo f32 [out, groups]) or None."""
    codes, scales, offsets = grid
    if codes.shape[1] % INT4_GROUP or int(codes.min()) < 0 or int(codes.max()) > 15:
        return None
    pairs = [t.view(t.shape[0], -1, 2) for t in (scales, offsets)]
    if not all(torch.equal(p[..., 0], p[..., 1]) for p in pairs):
        return None
    return codes.to(torch.uint8), pairs[0][..., 0].contiguous(), pairs[1][..., 0].contiguous()

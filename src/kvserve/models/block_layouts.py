"""GGUF block-quantized tensors packed, straight from the file's bytes, into the layouts
``native/int4_matmul.c`` reads (kernels.h's ``QL_*``): the file's codes and scales in the same number of
bytes or within 4% of it, rearranged for the kernel's vector loads, never through f32 weights.

    type   file bytes / 32 weights   layout    packed bytes / 32 weights
    Q4_0   18                        Q4_0      18
    Q4_1   20                        F16       20
    Q5_0   22                        Q5_0      22
    Q5_1   24                        Q5_1      24
    Q4_K   18   (144 / 256)          Q4_K      18.5  (6-bit scales and minimums widened to a byte)
    Q5_K   22   (176 / 256)          Q5_K      22.5
    Q6_K   26.25 (210 / 256)         Q6_K      26.25
    Q2_K   10.5 (84 / 256)           Q2_K      10.5
    Q3_K   13.75 (110 / 256)         Q3_K      14.25 (6-bit scales widened to a byte)

Q8_0 stays with ``native/int8_matmul.c`` (its grid at its own 34 bytes per 32). ``unpack_weight`` turns a
packed tensor back into f32 weights computed as the gguf library's dequantization computes them, which
the tests hold bit for bit against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvserve import native
from kvserve.host_memory import packed_bytes
from kvserve.models.layouts import (
    CODE_BITS,
    GGUF_LAYOUTS,
    GROUP_BYTES,
    HALVES,
    QL_F16,
    QL_F32,
    QL_Q2_K,
    QL_Q4_0,
    QL_Q4_K,
    QL_Q5_0,
    QL_Q5_1,
    QL_Q5_K,
    QL_Q6_K,
    ROW_CHUNK,
    SUPER_BYTES,
    panel_bytes,
)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of each block, as its two bytes [..., 2]."""
    return np.ascontiguousarray(blocks[..., at : at + 2])


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes of a 32-weight block -> its 32 codes: low nibbles are weights 0-15, high 16-31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """A 32-weight block's 4 bytes of fifth bits -> [..., 32] values 0 or 16 (bit j: weight j)."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & np.uint32(1)).astype(np.uint8) << np.uint8(4))


def _decode(type_name: str, blocks: np.ndarray):
    """File blocks [n, blocks per row, bytes] -> (codes uint8 [n, cols] in 0..63, per-group fields
    [(array [n, cols / 32, bytes])...], super-block fields [(array [n, cols / 256, bytes])...])."""
    n = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        affine = type_name.endswith("_1")
        qs = blocks[..., -16:]
        codes = _nibbles32(qs)
        if type_name.startswith("Q5"):
            codes |= _high_bits32(blocks[..., 4 if affine else 2 : 8 if affine else 6])
        fields = [_f16(blocks, 0)] + ([_f16(blocks, 2)] if affine else [])
        return codes.reshape(n, -1), fields, []
    if type_name in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        nb = blocks.shape[1]
        flat = blocks.reshape(n * nb, -1)
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(flat[:, 4:16]))
        qs = flat[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & np.uint8(0x0F)).reshape(-1, 8, 32)
        if type_name == "Q5_K":  # bit j of high byte i: sub-block j's weight i
            high = flat[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = codes | ((high & np.uint8(1)) << np.uint8(4))
        fields = [sc.reshape(n, nb * 8, 1), m.reshape(n, nb * 8, 1)]
        return codes.reshape(n, -1), fields, [_f16(blocks, 0), _f16(blocks, 2)]
    if type_name == "Q6_K":
        nb = blocks.shape[1]
        flat = blocks.reshape(n * nb, -1)
        ql = flat[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 4, 1)
        codes = (ql & np.uint8(0x0F)).reshape(-1, 256) | ((qh & np.uint8(3)).reshape(-1, 256) << np.uint8(4))
        scales = flat[:, 192:208].reshape(n, nb * 8, 2)  # int8 per 16: each group's two halves
        return codes.reshape(n, -1), [scales[..., :1], scales[..., 1:]], [_f16(blocks, 208)]
    if type_name in ("Q2_K", "Q3_K"):  # weight 128 a + 32 b + l: bits 2b of qs byte 32 a + l
        nb, q2 = blocks.shape[1], type_name == "Q2_K"
        flat = blocks.reshape(n * nb, -1)
        qs = flat[:, 16:80] if q2 else flat[:, 32:96]
        codes = (
            qs.reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & np.uint8(3)
        codes = codes.reshape(-1, 256)
        if q2:
            scales = flat[:, :16]  # sc | m << 4, the file's bytes
        else:  # hmask: bit b of byte l is weight 32 b + l's bit 2; 6-bit scales, low 4 bits then high 2
            high = (
                flat[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(
                    1, 8, 1)) & np.uint8(1)
            codes |= high.reshape(-1, 256) << np.uint8(2)
            s = flat[:, 96:108]
            low = (
                s[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(
                    -1, 16)
            top = (
                s[:, 8:].reshape(-1, 1, 4) >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)).reshape(
                    -1, 16)
            scales = ((low & np.uint8(0x0F)) | ((top & np.uint8(3)) << np.uint8(4))).astype(np.int16) - 32
            scales = scales.astype(np.int8).view(np.uint8)
        scales = scales.reshape(n, nb * 8, 2)
        supers = [_f16(blocks, 80), _f16(blocks, 82)] if q2 else [_f16(blocks, 108)]
        return codes.reshape(n, -1), [scales[..., :1], scales[..., 1:]], supers
    raise ValueError(f"no packed layout for {type_name}")


def _lanes(field: np.ndarray, panels: int) -> np.ndarray:
    """[rows, groups, bytes] -> [panels, groups, 16 x bytes]: each group's 16 outputs side by side."""
    rows, groups, width = field.shape
    padded = np.zeros((panels * 16, groups, width), dtype=np.uint8)
    padded[:rows] = field.view(np.uint8)
    return padded.reshape(panels, 16, groups, width).transpose(0, 2, 1, 3).reshape(panels, groups, 16 * width)


def _code_planes(codes: np.ndarray, panels: int, bits: int) -> np.ndarray:
    """codes [rows, cols] (0..63) -> [panels, groups, code bytes]: for 4 to 6 bits the nibble chunks and
    the planes of the fifth (and sixth) bits; for 2 or 3 bits the planes of bits 0-1 (and of bit 2);
    int4_matmul.c's order."""
    rows, cols = codes.shape
    groups = cols // 32
    padded = np.zeros((panels * 16, cols), dtype=np.uint8)
    padded[:rows] = codes
    quads = padded.reshape(panels, 16, groups, 8, 4).transpose(0, 2, 1, 4, 3)  # P G lane i quad

    def bit_plane(shift: int) -> np.ndarray:  # bit `shift` of each code, quad q at bit q
        bit = (quads >> shift) & 1
        return (bit << np.arange(8, dtype=np.uint8)).sum(-1, dtype=np.uint8).reshape(panels, groups, 64)

    def crumb_planes(shift: int) -> np.ndarray:  # bits shift, shift + 1: plane p holds quads 4p .. 4p + 3
        crumbs = ((quads >> shift) & 3).reshape(panels, groups, 16, 4, 2, 4)  # ... plane, quad in plane
        shifted = crumbs << (2 * np.arange(4, dtype=np.uint8))
        return shifted.sum(-1, dtype=np.uint8).transpose(0, 1, 4, 2, 3).reshape(panels, groups, 128)

    if bits < 4:
        return np.concatenate([crumb_planes(0)] + ([bit_plane(2)] if bits == 3 else []), axis=-1)
    q = padded.reshape(panels, 16, groups, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5)  # P G chunk half lane i
    parts = [(q[:, :, :, 0] & 0x0F | (q[:, :, :, 1] & 0x0F) << 4).reshape(panels, groups, 256)]
    if bits == 5:
        parts.append(bit_plane(4))
    elif bits == 6:
        parts.append(crumb_planes(4))
    return np.concatenate(parts, axis=-1)


def _packed_output(type_name: str, rows: int, cols: int) -> tuple[int, np.ndarray]:
    """(layout, u8 [panels, panel_bytes]) for a rows x cols tensor of ``type_name``, after checking its rows
    are whole file blocks."""
    layout, per_block, _ = GGUF_LAYOUTS[type_name]
    if cols % per_block:
        raise ValueError(f"{type_name}: rows of {cols} weights are not whole blocks of {per_block}")
    panels = -(-rows // 16)
    width = panel_bytes(layout, cols)
    return layout, packed_bytes(panels * width).reshape(panels, width)


def pack_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int,
                on_rows: Callable[[int], None] | None = None) -> np.ndarray:
    """A tensor's file bytes (rows x cols weights of ``type_name``, rows in order) -> u8 [panels,
    panel_bytes] in int4_matmul.c's layout for the type (``native/block_repack.c``; where it cannot be
    built, ``pack_blocks_reference``). ROW_CHUNK rows at a time; ``on_rows(n)`` hears after each chunk that
    the first n rows are packed (the loader drops their pages of the mapped file)."""
    repack = native.function("block_repack", "pack_gguf_blocks")
    if repack is None:
        return pack_blocks_reference(raw, type_name, rows, cols, on_rows)
    layout, out = _packed_output(type_name, rows, cols)
    blocks = np.ascontiguousarray(raw).reshape(rows, -1)  # the mapped file itself where it is contiguous
    threads = native.num_threads()
    for r in range(0, rows, ROW_CHUNK):
        n = min(ROW_CHUNK, rows - r)
        if repack(blocks[r:].ctypes.data, layout, n, cols, out[r // 16].ctypes.data, threads) != 0:
            raise ValueError(f"native repack refused {type_name} rows of {cols}")
        if on_rows is not None:
            on_rows(r + n)
    return out


def pack_blocks_reference(raw: np.ndarray, type_name: str, rows: int, cols: int,
                          on_rows: Callable[[int], None] | None = None) -> np.ndarray:
    """``pack_blocks`` in numpy: the reference the native repack is held to (tests), and the packer where
    no compiler is found."""
    layout, out = _packed_output(type_name, rows, cols)
    _, per_block, block_bytes = GGUF_LAYOUTS[type_name]
    blocks = raw.reshape(rows, cols // per_block, block_bytes)
    target, width = out, out.shape[1]
    groups, super_bytes = cols // 32, SUPER_BYTES[layout]
    for r in range(0, rows, ROW_CHUNK):
        chunk = blocks[r : r + ROW_CHUNK]
        p = -(-chunk.shape[0] // 16)
        codes, fields, supers = _decode(type_name, chunk)
        group = np.concatenate([_code_planes(codes, p, CODE_BITS[layout])] + [_lanes(f, p) for f in fields],
                               axis=-1)
        if super_bytes:
            heads = np.concatenate([_lanes(f, p) for f in supers], axis=-1)  # [p, groups / 8, super_bytes]
            group = np.concatenate([heads, group.reshape(p, groups // 8, -1)], axis=-1)
        target[r // 16 : r // 16 + p] = group.reshape(p, width)
        if on_rows is not None:
            on_rows(r + chunk.shape[0])
    return out


def _unlanes(part: np.ndarray, rows: int, dtype) -> np.ndarray:
    """[panels, groups, 16 x bytes] -> [rows, groups] values of ``dtype`` (``_lanes``' inverse)."""
    panels, groups, width = part.shape
    per = np.ascontiguousarray(part.reshape(panels, groups, 16, width // 16).transpose(0, 2, 1, 3))
    return per.reshape(panels * 16, groups, width // 16).view(dtype)[:rows, :, 0]


def _unpack_blocks(data: np.ndarray, layout: int, rows: int, panels: int, groups: int):
    """Packed bytes -> (each group's block [panels, groups, bytes], the super-blocks' d and dmin per group
    [rows, groups] f32, None where the layout has none)."""
    block, super_bytes = GROUP_BYTES[layout], SUPER_BYTES[layout]
    if not super_bytes:
        return data.reshape(panels, groups, block), None, None
    runs = data.reshape(panels, groups // 8, super_bytes + 8 * block)
    heads, blocks = runs[..., :super_bytes], runs[..., super_bytes:].reshape(panels, groups, block)
    d = np.repeat(_unlanes(heads[..., :32], rows, np.float16).astype(np.float32), 8, axis=1)
    dmin = np.repeat(_unlanes(heads[..., 32:], rows, np.float16).astype(np.float32), 8,
                     axis=1) if super_bytes == 64 else None
    return blocks, d, dmin


def _unpack_codes(blocks: np.ndarray, bits: int, panels: int, groups: int, cols: int):
    """Groups' blocks -> (codes uint8 [panels * 16, cols], the bytes after the code planes: the groups'
    scales and offsets)."""
    # P lane G i plane
    plane_lanes = lambda planes: planes.reshape(panels, groups, -1, 16, 4).transpose(0, 3, 1, 4, 2)

    def bit_plane(at: int, shift: int) -> np.ndarray:  # the 64-byte plane at `at` as bit `shift` of each code
        bit = (plane_lanes(blocks[..., at : at + 64])[..., 0][..., None] >> np.arange(8, dtype=np.uint8)) & 1
        return (bit.transpose(0, 1, 2, 4, 3).reshape(panels * 16, cols) << shift).astype(np.uint8)

    # the two 64-byte planes at `at` as bits shift, shift + 1
    def crumb_planes(at: int, shift: int) -> np.ndarray:
        planes = plane_lanes(blocks[..., at : at + 128])  # P lane G i plane
        crumbs = (planes[..., None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # P lane G i plane q
        return (crumbs.transpose(0, 1, 2, 4, 5, 3).reshape(panels * 16, cols) << shift).astype(np.uint8)

    if bits < 4:
        return crumb_planes(0, 0) | (bit_plane(128, 2) if bits == 3 else 0), blocks[..., 64 * bits :]
    nib = blocks[..., :256].reshape(panels, groups, 4, 16, 4)  # P G chunk lane i
    q = np.stack([nib & 0x0F, nib >> 4], axis=3)  # P G chunk half lane i
    codes = q.transpose(0, 4, 1, 2, 3, 5).reshape(panels * 16, cols).astype(np.uint8)
    if bits == 5:
        codes |= bit_plane(256, 4)
    elif bits == 6:
        codes |= crumb_planes(256, 4)
    return codes, blocks[..., 256 + 64 * (bits - 4) :]


def _group_scales(layout: int, sp: np.ndarray, rows: int, d, dmin):
    """(scale, offset) [rows, groups] f32 of each group of 32 in a layout outside ``HALVES``."""
    if layout == QL_F32:
        scale, lo = _unlanes(sp[..., :64], rows, np.float32), _unlanes(sp[..., 64:128], rows, np.float32)
    elif layout in (QL_F16, QL_Q5_1):
        scale, lo = (_unlanes(sp[..., a : a + 32], rows, np.float16).astype(np.float32) for a in (0, 32))
    elif layout in (QL_Q4_0, QL_Q5_0):
        scale = _unlanes(sp[..., :32], rows, np.float16).astype(np.float32)
        lo = scale * np.float32(-8.0 if layout == QL_Q4_0 else -16.0)
    elif layout in (QL_Q4_K, QL_Q5_K):
        scale = d * _unlanes(sp[..., :16], rows, np.uint8).astype(np.float32)
        lo = -dmin * _unlanes(sp[..., 16:32], rows, np.uint8).astype(np.float32)
    return scale, lo


def _half_scales(layout: int, sp: np.ndarray, rows: int, d, dmin):
    """(scale, offset) [rows, groups, 2, 1] f32 of a ``HALVES`` layout: two halves of 16 with a scale (and
    offset) each."""
    fields = [_unlanes(sp[..., 16 * h : 16 * h + 16], rows, np.uint8 if layout == QL_Q2_K else np.int8)
              for h in (0, 1)]
    if layout == QL_Q2_K:  # sc | m << 4
        scale = np.stack([d * (f & 0x0F).astype(np.float32) for f in fields], -1)[..., None]
        lo = np.stack([-dmin * (f >> 4).astype(np.float32) for f in fields], -1)[..., None]
        return scale, lo
    # [rows, groups, 2, 1]
    scale = np.stack([d * f.astype(np.float32) for f in fields], -1)[..., None]
    return scale, scale * np.float32(-32.0 if layout == QL_Q6_K else -4.0)


def unpack_weight(packed: np.ndarray, layout: int, rows: int, cols: int) -> np.ndarray:
    """A packed tensor's weights [rows, cols] f32, each scale * code + offset computed in f32 as the gguf
    library's dequantization computes the file's weight."""
    data = np.asarray(packed).reshape(-1)
    panels, groups = -(-rows // 16), cols // 32
    blocks, d, dmin = _unpack_blocks(data, layout, rows, panels, groups)
    codes, sp = _unpack_codes(blocks, CODE_BITS[layout], panels, groups, cols)
    codes = codes[:rows].astype(np.float32).reshape(rows, groups, 32)
    if layout in HALVES:
        scale, lo = _half_scales(layout, sp, rows, d, dmin)
        w = codes.reshape(rows, groups, 2, 16) * scale + lo
        return np.ascontiguousarray(w.reshape(rows, cols), dtype=np.float32)
    scale, lo = _group_scales(layout, sp, rows, d, dmin)
    w = codes * scale[..., None] + lo[..., None]
    return np.ascontiguousarray(w.reshape(rows, cols), dtype=np.float32)

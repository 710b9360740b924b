"""The kernels' weight layouts as numbers and rules, without torch (the planner reads them): which
layout holds a GGUF tensor of each type, and what it costs. models/block_layouts.py packs them;
models/file_linears.py makes the projections; plan/model_spec.py counts their bytes.
"""

from __future__ import annotations

# kernels.h's QL_* enum
QL_F16, QL_F32, QL_Q4_0, QL_Q5_0, QL_Q5_1, QL_Q4_K, QL_Q5_K, QL_Q6_K, QL_Q2_K, QL_Q3_K = range(10)
LAYOUT_NAMES = ("F16", "F32", "Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
GROUP_BYTES = (320, 384, 288, 352, 384, 288, 352, 416, 160, 224)  # a panel's group of 32 inputs x 16 outputs
# the K-quants' d (and dmin) for 16 outputs, before each 8 groups
SUPER_BYTES = (0, 0, 0, 0, 0, 64, 64, 32, 64, 32)
CODE_BITS = (4, 4, 4, 5, 5, 4, 5, 6, 2, 3)
HALVES = (QL_Q6_K, QL_Q2_K, QL_Q3_K)  # a scale (and offset) per 16 inputs, not per 32

# GGUF type -> (layout, weights per file block, bytes per file block)
GGUF_LAYOUTS = {
    "Q4_0": (QL_Q4_0, 32, 18),
    "Q4_1": (QL_F16, 32, 20),
    "Q5_0": (QL_Q5_0, 32, 22),
    "Q5_1": (QL_Q5_1, 32, 24),
    "Q4_K": (QL_Q4_K, 256, 144),
    "Q5_K": (QL_Q5_K, 256, 176),
    "Q6_K": (QL_Q6_K, 256, 210),
    "Q2_K": (QL_Q2_K, 256, 84),
    "Q3_K": (QL_Q3_K, 256, 110),
}
ROW_CHUNK = 1024  # rows decoded at a time (a multiple of 16): temporaries of a few MiB


def panel_bytes(layout: int, cols: int) -> int:
    groups = cols // 32
    return groups * GROUP_BYTES[layout] + groups // 8 * SUPER_BYTES[layout]


def packed_bytes(type_name: str, rows: int, cols: int) -> int:
    """Bytes ``pack_blocks`` makes of a rows x cols tensor of ``type_name``."""
    return -(-rows // 16) * panel_bytes(GGUF_LAYOUTS[type_name][0], cols)


def supports(type_name: str, cols: int) -> bool:
    """Whether a tensor of this type and row length has a layout here."""
    entry = GGUF_LAYOUTS.get(type_name)
    return entry is not None and cols % entry[1] == 0


INT8_SOURCES = {"Q8_0": 0, "Q5_0": 1, "Q4_0": 2}  # kernels.h's INT8_FROM_*: int8_matmul.c's groups of 32


def holder(type_name: str, cols: int) -> str | None:
    """Which layout holds a tensor of this type from its blocks: its own block layout ("Q4_K", ...), the
    int8 groups ("int8": Q8_0), or None (through f32)."""
    if supports(type_name, cols):
        return type_name
    return "int8" if type_name in INT8_SOURCES and cols % 32 == 0 else None


def runs(parts: list[tuple[str, int, int]]) -> list[tuple[str, int, int]] | None:
    """A stack's parts (type, rows, cols) as runs of neighbours one layout holds: (holder, first part,
    end part); None where some part has no holder or the parts' row lengths differ."""
    if len({cols for _, _, cols in parts}) != 1:
        return None
    kinds = [holder(t, cols) for t, _, cols in parts]
    if any(k is None for k in kinds):
        return None
    out: list[tuple[str, int, int]] = []
    for i, kind in enumerate(kinds):
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], i + 1)
        else:
            out.append((kind, i, i + 1))
    return out

"""The operations of ``model_step.c``, written from kernels.h's prototypes.

    operation = OP_FIELDS int64 words: [kind, function address, word 0, word 1, ...]
                word i: parameter i of the function, in kernels.h's order
                        (a pointer as its address, an int as itself, a float as the bits of a double)

The caller names every parameter (as kernels.h names it) except those the step passes itself on every
call (``STEP_ARGS``); ``operation`` orders and converts them by the declaration. So the layout has no
second copy here: a parameter added, dropped or moved in the header moves here too, and a name the
header does not have raises. ``model_step.c`` reads word i in argument position i through the same
declaration, and tests/native/test_kernel_abi.py runs every kind against recording stand-ins.
"""

from __future__ import annotations

import ctypes
import struct
from functools import cache

from kvserve import native
from kvserve.native import abi

# The functions an operation calls, and per function the parameters model_step.c fills in itself
# (what changes between steps), each with what it passes there: a model_step parameter, or a part of the
# batch (BATCH_PARTS). The prefill attention's q and out are the operation's, advanced to each chunk's
# first row.
STEP_ARGS = {
    "rms_norm": {"n": "n"},
    "add_rms_norm": {"n": "n"},
    "int4_matmul": {"M": "n"},
    "rope_in_place": {"tokens": "n"},
    "copy_rows": {"n": "n"},
    "gather_rows": {"rows": "decode_rows", "n": "decodes"},
    "scatter_rows": {"rows": "decode_rows", "n": "decodes"},
    "kv_write": {"tokens": "n", "slot_rows": "slot_rows"},
    "paged_prefill_attention": {"n": "sequence_rows", "q_start": "sequence_position",
                                "block_table": "sequence_tables"},
    "paged_decode_attention": {"n": "decodes", "block_tables": "block_tables", "table_stride": "table_stride",
                               "context_lens": "context_lens"},
    "silu_mul": {"n": "n"},
    "gelu_tanh_mul": {"n": "n"},
    "int8_matmul": {"M": "n"},
    "int8_matmul_g16": {"M": "n"},
    "rms_norm_heads": {"tokens": "n"},
}
_RANGES = {ctypes.c_int: 32, ctypes.c_int64: 64}  # bits of the integer types


def op_fields() -> int:
    return abi.header().constants["OP_FIELDS"]


# What the batch gives (kernels.h's BATCH_*): the number of decodes and their rows; per prefill chunk its
# rows and the position of its first.
BATCH_PARTS = ("decodes", "decode_rows", "sequence_rows", "sequence_position")
# The step's arrays with one part per KV group: an operation's word for them holds its group.
PER_KV_GROUP = ("block_tables", "slot_rows", "sequence_tables")


def operation(kernel: str, address: int, kv_group: int = 0, **args: float | None) -> list[int]:
    """The words of one operation calling ``kernel`` at ``address``, padded to OP_FIELDS. ``args``:
    every parameter of ``kernel`` but STEP_ARGS[kernel]'s, by name; ``kv_group``: the KV group whose
    block tables and slot rows it takes (see model_step.c)."""
    proto, step = abi.prototype(kernel), STEP_ARGS[kernel]
    wanted = [p.name for p in proto.params if p.name not in step]
    if sorted(args) != sorted(wanted):
        missing, unknown = set(wanted) - set(args), set(args) - set(wanted)
        raise TypeError(f"step operation {kernel}: kernels.h's parameters are {wanted} "
                        f"(missing {sorted(missing)}, not parameters {sorted(unknown)})")
    words = [abi.header().constants[f"OP_{kernel.upper()}"], address]
    words += [
        (kv_group if step[p.name] in PER_KV_GROUP else 0) if p.name in step else _word(
            kernel, p, args[p.name])
              for p in proto.params]
    if len(words) > op_fields():
        raise ValueError(f"step operation {kernel}: {len(words)} words, OP_FIELDS is {op_fields()}")
    return words + [0] * (op_fields() - len(words))


def _word(kernel: str, param: abi.Parameter, value: float | None) -> int:
    """``value`` as the int64 word model_step.c reads for a parameter of this type."""
    kind = abi.ctype(param.type)
    if kind is ctypes.c_float:
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]  # model_step.c's arg_float
    if kind is ctypes.c_void_p:
        return int(value or 0)
    bits = _RANGES[kind]
    if not -(2 ** (bits - 1)) <= int(value) < 2 ** (bits - 1):
        raise ValueError(f"step operation {kernel}: {param.name}={value} does not fit {param.type}")
    return int(value)


@cache
def kernel_addresses() -> dict[str, int] | None:
    """The address of every function an operation calls, by name (each from the library kernels.h
    says exports it); None where a library cannot be loaded."""
    out = {}
    for name in STEP_ARGS:
        library = native.load(abi.prototype(name).source)
        if library is None:
            return None
        out[name] = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    return out

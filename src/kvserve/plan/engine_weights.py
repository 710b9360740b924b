"""Bytes of weights the engine holds once a model is loaded, per weight format (``--weights``), from
the tensor table alone: what ``models.linear`` makes of each tensor, counted without loading it.

    f32, bf16 (and any model without a tensor table)   every parameter at --dtype: an upper bound
    int8, q4, q4-fast   the embedding at --dtype; the output head (or the embedding it ties to) as
                        int8 groups of 32 with f16 scales (34 bytes a group, rows padded to 16); each
                        projection (q/k/v and gate/up fused, as the model fuses them) as 4-bit groups
                        (20 bytes a group of 32, rows padded to 16) when q4/q4-fast and every part is
                        Q4_1 (a grid the conversion keeps exactly), else int8 rows with an f32 scale;
                        norms and biases at --dtype

Plain integers; no torch.
"""

from __future__ import annotations

import math

from kvserve.config import CPU_GGUF_WEIGHTS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GROUP = 32
FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def engine_weight_bytes(tensors: tuple[tuple[str, str, tuple[int, ...]], ...], num_params: int, weights: str,
                        dtype: str) -> int:
    """tensors: (name, ggml type, GGUF dims: inputs first) of a GGUF file, empty for other sources;
    weights: a ``--weights`` choice, "auto" resolving as the loader does on the CPU."""
    fb = DTYPE_BYTES[dtype]
    weights = resolve_weights(weights, tensors)
    if weights not in ("int8", "q4", "q4-fast") or not tensors:
        return num_params * fb
    by_name = {name: (type_name, dims) for name, type_name, dims in tensors}
    total, counted = 0, set()
    for name, (type_name, dims) in by_name.items():
        if name == "token_embd.weight":
            total += math.prod(dims) * fb + (0 if "output.weight" in by_name else head_bytes(dims))
        elif name == "output.weight":
            total += head_bytes(dims)
        elif name not in counted and _projection(name):
            parts = _fused_with(name, by_name)
            counted.update(parts)
            k, n = by_name[parts[0]][1][0], sum(by_name[p][1][1] for p in parts)
            four_bit = weights != "int8" and k % GROUP == 0 and all(by_name[p][0] == "Q4_1" for p in parts)
            total += _padded(n) * (k // GROUP) * 20 if four_bit else n * k + 4 * n
        elif name not in counted:
            total += math.prod(dims) * fb
    return total


def resolve_weights(weights: str, tensors: tuple) -> str:
    """"auto" as the loader resolves it on the CPU: q4 (config.CPU_GGUF_WEIGHTS) for a GGUF file, else f32."""
    return (CPU_GGUF_WEIGHTS if tensors else "f32") if weights == "auto" else weights


def head_bytes(dims: tuple[int, ...]) -> int:
    k, n = dims
    return _padded(n) * -(-k // GROUP) * 34


def _padded(rows: int) -> int:
    return -(-rows // 16) * 16


def _projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and any(parts[2] in f for f in FUSED)


def _fused_with(name: str, by_name: dict) -> list[str]:
    """The tensors the model concatenates into one projection with ``name`` (those present)."""
    prefix, kind = name.rsplit(".", 2)[0], name.split(".")[2]
    group = next(f for f in FUSED if kind in f)
    return [f"{prefix}.{k}.weight" for k in group if f"{prefix}.{k}.weight" in by_name]

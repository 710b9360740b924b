"""A pure decode step of ``DecoderLM`` in one native call (``native/decode_step.c``).

``DecoderLM.forward`` calls a C kernel, or a torch op, ~300 times a decode step; at one sequence and
short context that Python is ~3 ms of an ~8 ms step. ``NativeDecodeStep`` writes the same kernel calls
once, as a list of operations over activation buffers it owns, and a step becomes: the embedding
rows, the RoPE rows, one call. The arithmetic is the same calls with the same arguments, so the
hidden states are the same bits as ``forward``'s (tested).

It covers what those kernels cover: the Llama family on the CPU in f32 with 4-bit weights
(``--weights q4`` / ``q4-fast``), SiLU, one RoPE table, and KV codecs the C writer and the decode
kernel both take (all but fp8). ``for_model`` returns None for anything else (Gemma's extra norms and
GELU, other weight formats, fp8 KV, no compiler), and the engine keeps ``forward``.
"""

from __future__ import annotations

import ctypes
import struct
from functools import cache

import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.kv.storage import PagedKVStorage
from kvserve.models.decoder import DecoderLM
from kvserve.models.linear import Int4Linear

OP_FIELDS = 32  # words an operation, as in decode_step.c
RMS_NORM, ADD_RMS_NORM, INT4_MATMUL, ROPE, COPY_ROWS, KV_WRITE, DECODE_ATTENTION, SILU_MUL = range(1, 9)

_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@cache
def _kernels() -> dict[str, int] | None:
    """Addresses of the functions a step calls, and the step itself; None where any is missing."""
    wanted = {"rms_norm": ("rms_norm", "add_rms_norm"), "int4_matmul": ("int4_matmul",), "rope": ("rope_in_place",),
              "kv_write": ("kv_write",), "paged_attention": ("paged_decode_attention",), "silu_mul": ("silu_mul",)}
    out = {}
    for source, names in wanted.items():
        lib = native.load(source)
        if lib is None:
            return None
        for name in names:
            out[name] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    return out


@cache
def _step_function():
    return native.function("decode_step", "decode_step", (_p, _i, _i, _p, _i64, _p, _p, _p, _p), _i)


def _float_word(value: float) -> int:
    """A float as decode_step.c's arg_float reads it: the bits of a double."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def supports(model: DecoderLM) -> bool:
    """Whether every call of this model's decode step has a kernel (see the module's docstring)."""
    cfg = model.config
    plain_layers = all(
        layer.q_norm is None and layer.k_norm is None and layer.post_attn_norm is None
        and layer.post_ffn_norm is None for layer in model.layers)
    four_bit = all(
        isinstance(lin, Int4Linear) and lin.kernel is not None
        for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return (model.device.type == "cpu" and model.dtype == torch.float32 and plain_layers and four_bit
            and cfg.hidden_act == "silu" and cfg.embedding_scale == 1.0 and model.rope_local is model.rope)


def for_model(model: DecoderLM, storage: PagedKVStorage) -> NativeDecodeStep | None:
    """The one-call decode step for this model and KV cache, or None where it does not apply."""
    if not supports(model) or _kernels() is None or _step_function() is None:
        return None
    attention = native_paged.for_storage(storage)
    writer = native_paged.writer_for_storage(storage)
    if attention is None or not isinstance(writer, native_paged.NativeKVWrite):
        return None
    if any(part is None for layer in writer.layer_args for part in layer):
        return None  # a codec the C writer does not take (fp8)
    return NativeDecodeStep(model, attention, writer)


class NativeDecodeStep:
    """Runs ``model.forward`` for a batch of single-token sequences in one native call. Holds the KV
    cache's addresses (through the attention kernel's and the writer's argument packs), not the cache:
    its owner keeps both alive together."""

    def __init__(self, model: DecoderLM, attention: native_paged.NativePagedAttention,
                 writer: native_paged.NativeKVWrite) -> None:
        self.model, self.attention, self.writer = model, attention, writer
        self.capacity = 0
        self.threads = -1
        self.calls = 0  # steps run (tests check the path was taken)

    def _plan(self, capacity: int, threads: int) -> None:
        """Activation buffers for ``capacity`` sequences and the operations over them."""
        model, cfg = self.model, self.model.config
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, q_dim, kv_dim = cfg.hidden_size, heads * d, kv_heads * d
        qkv_dim, inter = q_dim + 2 * kv_dim, model.layers[0].gate_up.out_features // 2

        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(capacity, width)

        b = self.buffers = {name: buffer(width) for name, width in (
            ("x", hidden), ("h", hidden), ("qkv", qkv_dim), ("q", q_dim), ("k", kv_dim), ("v", kv_dim),
            ("attn", q_dim), ("o", hidden), ("gate_up", 2 * inter), ("act", inter), ("down", hidden),
            ("out", hidden))}
        ptr = {name: t.data_ptr() for name, t in b.items()}
        fn = _kernels()
        eps = _float_word(cfg.rms_norm_eps)
        ops: list[list[int]] = []

        def matmul(lin: Int4Linear, x: str, y: str) -> None:
            bias = 0 if lin.bias is None else lin.bias.data_ptr()
            ops.append([INT4_MATMUL, fn["int4_matmul"], ptr[x], lin.packed.data_ptr(), bias, lin.out_features,
                        b[x].shape[1], ptr[y], threads, lin.digits])

        qkv = ptr["qkv"]
        for i, layer in enumerate(model.layers):
            if i == 0:
                ops.append([RMS_NORM, fn["rms_norm"], ptr["x"], layer.attn_norm.data_ptr(), eps, hidden, ptr["h"]])
            else:
                ops.append([ADD_RMS_NORM, fn["add_rms_norm"], ptr["x"], ptr["down"], layer.attn_norm.data_ptr(), eps,
                            hidden, ptr["h"]])
            matmul(layer.qkv, "h", "qkv")
            ops.append([ROPE, fn["rope_in_place"], qkv, heads + kv_heads, qkv_dim, d])
            for name, offset, width in (("q", 0, q_dim), ("k", q_dim, kv_dim), ("v", q_dim + kv_dim, kv_dim)):
                ops.append([COPY_ROWS, 0, qkv + 4 * offset, qkv_dim, ptr[name], width, width])
            for name, (kind, codes, code_stride, scales, scale_stride, rotation, levels) in zip(
                    ("k", "v"), self.writer.layer_args[i]):
                ops.append([KV_WRITE, fn["kv_write"], kind, ptr[name], kv_heads, d, codes, code_stride, scales,
                            scale_stride, rotation, levels])
            window = cfg.sliding_window if cfg.is_sliding(i) else 0
            parts = self.attention.layer_args[i]
            ops.append([DECODE_ATTENTION, fn["paged_decode_attention"], heads, kv_heads, d, ptr["q"], ptr["attn"],
                        self.attention.num_blocks, self.attention.block_size, window or 0, _float_word(model.scale),
                        *parts, *self.attention.rotation_args, threads])
            matmul(layer.o, "attn", "o")
            ops.append([ADD_RMS_NORM, fn["add_rms_norm"], ptr["x"], ptr["o"], layer.ffn_norm.data_ptr(), eps, hidden,
                        ptr["h"]])
            matmul(layer.gate_up, "h", "gate_up")
            ops.append([SILU_MUL, fn["silu_mul"], ptr["gate_up"], inter, ptr["act"]])
            matmul(layer.down, "act", "down")
        ops.append([ADD_RMS_NORM, fn["add_rms_norm"], ptr["x"], ptr["down"], model.final_norm.data_ptr(), eps, hidden,
                    ptr["out"]])
        self.ops = torch.tensor([op + [0] * (OP_FIELDS - len(op)) for op in ops], dtype=torch.int64)
        self.capacity, self.threads = capacity, threads

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions, context_lens [n] int64; block_tables [n, max_blocks] int64; slot_rows
        [kv_heads * n] (``PagedKVStorage.slot_rows``). Returns the final hidden states [n, hidden]."""
        n = input_ids.shape[0]
        threads = torch.get_num_threads()
        if n > self.capacity or threads != self.threads:
            self._plan(max(n, 2 * self.capacity if n > self.capacity else self.capacity), threads)
        model = self.model
        model.embed_tokens(input_ids, out=self.buffers["x"][:n])
        cos, sin = model.rope.tables(positions, int(positions.max()))
        tables, lens, rows = (t.contiguous() for t in (block_tables, context_lens, slot_rows))
        failed = _step_function()(self.ops.data_ptr(), self.ops.shape[0], n, tables.data_ptr(), tables.stride(0),
                                  lens.data_ptr(), rows.data_ptr(), cos.data_ptr(), sin.data_ptr())
        if failed:
            raise MemoryError(f"native decode step: operation {failed - 1} could not allocate its workspace")
        self.calls += 1
        return self.buffers["out"][:n].clone()

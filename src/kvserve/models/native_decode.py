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

from functools import cache

import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.kv.storage import PagedKVStorage
from kvserve.models.decoder import DecoderLM
from kvserve.models.linear import Int4Linear
from kvserve.native.decode_ops import kernel_addresses, operation


@cache
def _step_function():
    return native.function("decode_step", "decode_step")


def supports(model: DecoderLM) -> bool:
    """Whether every call of this model's decode step has a kernel (see the module's docstring)."""
    cfg = model.config
    plain_layers = all(
        layer.q_norm is None and layer.k_norm is None and layer.post_attn_norm is None
        and layer.post_ffn_norm is None for layer in model.layers)
    four_bit = all(
        isinstance(lin, Int4Linear) and lin.kernel is not None
        for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    plain_config = (cfg.hidden_act == "silu" and cfg.embedding_scale == 1.0 and cfg.residual_scale == 1.0
                    and cfg.rotary_dim is None and not cfg.attn_logit_softcap and not cfg.num_experts)
    return (model.device.type == "cpu" and model.dtype == torch.float32 and plain_layers and four_bit
            and plain_config and model.rope_local is model.rope)


def for_model(model: DecoderLM, storage: PagedKVStorage) -> NativeDecodeStep | None:
    """The one-call decode step for this model and KV cache, or None where it does not apply."""
    if not supports(model) or kernel_addresses() is None or _step_function() is None:
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
        cfg = self.model.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, self.model.layers[0].gate_up.out_features // 2
        self.buffers = {name: torch.zeros(capacity, width) for name, width in (
            ("x", hidden), ("h", hidden), ("qkv", q_dim + 2 * kv_dim), ("q", q_dim), ("k", kv_dim),
            ("v", kv_dim), ("attn", q_dim), ("o", hidden), ("gate_up", 2 * inter), ("act", inter),
            ("down", hidden), ("out", hidden))}
        self.ops = torch.tensor(self._operations(threads), dtype=torch.int64)
        self.capacity, self.threads = capacity, threads

    def _operations(self, threads: int) -> list[list[int]]:
        """The step's kernel calls over ``self.buffers``, each parameter named as kernels.h names it."""
        model, cfg, b = self.model, self.model.config, self.buffers
        heads, kv_heads, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        ptr = {name: t.data_ptr() for name, t in b.items()}
        fn, eps, qkv, qkv_dim = kernel_addresses(), cfg.rms_norm_eps, ptr["qkv"], b["qkv"].shape[1]
        ops: list[list[int]] = []

        def op(kernel: str, **args) -> None:
            ops.append(operation(kernel, fn[kernel], **args))

        def matmul(lin: Int4Linear, x: str, y: str) -> None:
            bias = None if lin.bias is None else lin.bias.data_ptr()
            op("int4_matmul", x=ptr[x], w=lin.packed.data_ptr(), bias=bias, N=lin.out_features,
               K=b[x].shape[1], y=ptr[y], num_threads=threads, digits=lin.digits)

        def add_norm(h: str, w: torch.Tensor, out: str) -> None:
            op("add_rms_norm", x=ptr["x"], h=ptr[h], h_is_bf16=0, w=w.data_ptr(), eps=eps, hidden=hidden,
               out=ptr[out])

        for i, layer in enumerate(model.layers):
            if i == 0:
                op("rms_norm", x=ptr["x"], w=layer.attn_norm.data_ptr(), eps=eps, hidden=hidden, out=ptr["h"])
            else:
                add_norm("down", layer.attn_norm, "h")
            matmul(layer.qkv, "h", "qkv")
            op("rope_in_place", x=qkv, heads=heads + kv_heads, token_stride=qkv_dim, D=d)
            offset = 0
            for name in ("q", "k", "v"):
                width = b[name].shape[1]
                op("copy_rows", src=qkv + 4 * offset, src_stride=qkv_dim, dst=ptr[name], dst_stride=width,
                   width=width)
                offset += width
            for name, (kind, codes, code_stride, scales, scale_stride, rotation, levels) in zip(
                    ("k", "v"), self.writer.layer_args[i]):
                op("kv_write", kind=kind, x=ptr[name], kv_heads=kv_heads, D=d, codes=codes,
                   code_stride=code_stride, scales=scales, scale_stride=scale_stride, rotation=rotation,
                   levels=levels)
            window = cfg.sliding_window if cfg.is_sliding(i) else None
            op("paged_decode_attention", num_heads=heads, num_kv_heads=kv_heads, head_dim=d, q=ptr["q"],
               out=ptr["attn"], window=window or 0, scale=model.scale, num_threads=threads,
               **self._attention_cache_args(i))
            matmul(layer.o, "attn", "o")
            add_norm("o", layer.ffn_norm, "h")
            matmul(layer.gate_up, "h", "gate_up")
            op("silu_mul", gate_up=ptr["gate_up"], inter=b["act"].shape[1], out=ptr["act"])
            matmul(layer.down, "act", "down")
        add_norm("down", model.final_norm, "out")
        return ops

    def _attention_cache_args(self, layer: int) -> dict[str, int]:
        """paged_decode_attention's arguments that describe the KV cache of ``layer``, by name."""
        attention, parts = self.attention, self.attention.layer_args[layer]
        q_rotation, out_rotation = attention.rotation_args
        kv = {f"{side}_{field}": value for side, part in (("k", parts[:6]), ("v", parts[6:]))
              for field, value in zip(native_paged.KV_PART, part)}
        return dict(kv, num_blocks=attention.num_blocks, block_size=attention.block_size, q_rotation=q_rotation,
                    out_rotation=out_rotation)

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

"""A pure decode step of ``DecoderLM`` in one native call (``native/decode_step.c``).

``DecoderLM.forward`` calls a C kernel, or a torch op, ~300 times a decode step; at one sequence and
short context that Python is ~3 ms of an ~8 ms step. ``NativeDecodeStep`` writes the same kernel calls
once, as a list of operations over activation buffers it owns, and a step becomes: the embedding
rows, the RoPE rows, one call. The arithmetic is the same calls with the same arguments, so the
hidden states are the same bits as ``forward``'s (tested).

It covers what those kernels cover: decoders on the CPU in f32 whose projections all run through the
4-bit or int8 kernels (``--weights q4`` / ``q4-fast`` / ``int8``), SiLU or GELU gating, q/k norms per
head, post-norms, an embedding scale, a second RoPE table for sliding layers, soft-capped attention
scores (the Llama family, Qwen3, Gemma 2 and 3; Gemma 2's capped logits come after the step, in
``compute_logits``), and KV codecs the C writer and the decode kernel both take (all but fp8).
``for_model`` returns None for anything else (partial rotary, residual multipliers, experts, other
weight formats, fp8 KV, no compiler), and the engine keeps ``forward``.
"""

from __future__ import annotations

from functools import cache

import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.kv.storage import PagedKVStorage
from kvserve.models import activations
from kvserve.models.decoder import LAYER_STEPS, DecoderLM
from kvserve.models.linear import Int4Linear, Int8GroupLinear, StackedLinear
from kvserve.native.decode_ops import kernel_addresses, operation


@cache
def _step_function():
    return native.function("decode_step", "decode_step")


def _kernel_name(lin) -> str | None:
    """The native matmul a projection runs through ("stacked": each part its own), or None where it has none."""
    if isinstance(lin, StackedLinear):
        return "stacked" if all(_kernel_name(part) not in (None, "stacked") for part in lin.parts) else None
    if isinstance(lin, Int4Linear) and lin.kernel is not None:
        return "int4_matmul"
    if isinstance(lin, Int8GroupLinear) and lin.kernel is not None:
        return "int8_matmul_g16" if lin.layout == "g16" else "int8_matmul"
    return None


def supports(model: DecoderLM) -> bool:
    """Whether every call of this model's decode step has a kernel (see the module's docstring)."""
    cfg = model.config
    native_matmuls = all(
        layer.moe is None and all(_kernel_name(lin) is not None for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        for layer in model.layers)
    head_norms = all(layer.q_norm is None or cfg.qk_norm_per_head for layer in model.layers)
    plain_config = (cfg.residual_scale == 1.0 and cfg.rotary_dim is None and not cfg.num_experts
                    and activations.gate_kernel(cfg.hidden_act) is not None)
    return (model.device.type == "cpu" and model.dtype == torch.float32 and native_matmuls and head_norms
            and plain_config)


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
    return NativeDecodeStep(model, attention, writer, storage.kv_group_of_layer)


class NativeDecodeStep:
    """Runs ``model.forward`` for a batch of single-token sequences in one native call. Holds the KV
    cache's addresses (through the attention kernel's and the writer's argument packs), not the cache:
    its owner keeps both alive together."""

    def __init__(self, model: DecoderLM, attention: native_paged.NativePagedAttention,
                 writer: native_paged.NativeKVWrite, kv_groups: list[int] | None = None) -> None:
        self.model, self.attention, self.writer = model, attention, writer
        self.kv_groups = kv_groups or [0] * len(model.layers)  # per layer, its KV group
        self.capacity = 0
        self.threads = -1
        self.calls = 0  # steps run (tests check the path was taken)

    def _plan(self, capacity: int, threads: int) -> None:
        """Activation buffers for ``capacity`` sequences and the operations over them."""
        model, cfg = self.model, self.model.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, model.layers[0].gate_up.out_features // 2
        widths = {"x": hidden, "h": hidden, "qkv": q_dim + 2 * kv_dim, "q": q_dim, "k": kv_dim, "v": kv_dim,
                  "attn": q_dim, "o": hidden, "o_normed": hidden, "gate_up": 2 * inter, "act": inter,
                  "down": hidden, "down_normed": hidden, "out": hidden, "cos": cfg.head_dim, "sin": cfg.head_dim}
        if model.rope_local is not model.rope:
            widths |= {"cos_local": cfg.head_dim, "sin_local": cfg.head_dim}
        self.buffers = {name: torch.zeros(capacity, width) for name, width in widths.items()}
        self.ops = torch.tensor(self._operations(threads), dtype=torch.int64)
        self.capacity, self.threads = capacity, threads

    def _operations(self, threads: int) -> list[list[int]]:
        """The step's kernel calls over ``self.buffers``, each parameter named as kernels.h names it:
        ``DecoderLM.steps``, the list ``forward`` runs, each step as the kernels that do it."""
        model, cfg, b = self.model, self.model.config, self.buffers
        heads, kv_heads, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        ptr = {name: t.data_ptr() for name, t in b.items()}
        fn, eps, qkv, qkv_dim = kernel_addresses(), cfg.rms_norm_eps, ptr["qkv"], b["qkv"].shape[1]
        ops: list[list[int]] = []

        def op(kernel: str, kv_group: int = 0, **args) -> None:
            ops.append(operation(kernel, fn[kernel], kv_group, **args))

        def matmul(lin, x: str, y: str) -> None:
            """One operation a projection; a stacked one's parts each write their columns of y."""
            first = 0
            for part in lin.parts if isinstance(lin, StackedLinear) else [lin]:
                bias = None if part.bias is None else part.bias.data_ptr()
                kernel = _kernel_name(part)
                options = {"digits": part.digits, "layout": part.layout} if kernel == "int4_matmul" else {}
                op(kernel, x=ptr[x], w=part.packed.data_ptr(), bias=bias, N=part.out_features, K=b[x].shape[1],
                   y=ptr[y] + 4 * first, num_threads=threads, ldy=b[y].shape[1], **options)
                first += part.out_features

        def norm(x: str, w: torch.Tensor, out: str) -> None:
            op("rms_norm", x=ptr[x], w=w.data_ptr(), eps=eps, hidden=hidden, out=ptr[out])

        def add_norm(h: str, w: torch.Tensor, out: str) -> None:
            op("add_rms_norm", x=ptr["x"], h=ptr[h], h_is_bf16=0, w=w.data_ptr(), eps=eps, hidden=hidden,
               out=ptr[out])

        def head_norm(first: int, count: int, w: torch.Tensor) -> None:
            op("rms_norm_heads", x=qkv + 4 * first * d, heads=count, token_stride=qkv_dim, D=d, w=w.data_ptr(),
               eps=eps)

        gate = activations.GATE_KERNELS[cfg.hidden_act][1]
        pending = None  # the buffer holding the last block's output, added by the next norm
        for kind, *args in model.steps:  # DecoderLM.forward's steps, as kernel calls
            i = args[0] if kind in LAYER_STEPS else None
            layer = model.layers[i] if i is not None else None
            if kind == "norm":
                out = "out" if args[1] else "h"
                if pending is None:
                    norm("x", args[0], out)
                else:
                    add_norm(pending, args[0], out)
                    pending = None
            elif kind == "qkv":
                matmul(layer.qkv, "h", "qkv")
            elif kind == "qk_norm":
                head_norm(0, heads, layer.q_norm)
                head_norm(heads, kv_heads, layer.k_norm)
            elif kind == "rope":
                table = "_local" if cfg.is_sliding(i) and model.rope_local is not model.rope else ""
                op("rope_in_place", x=qkv, heads=heads + kv_heads, token_stride=qkv_dim, D=d, cos=ptr["cos" + table],
                   sin=ptr["sin" + table])
            elif kind == "attend":
                self._attend(op, i, threads)
            elif kind == "o":
                matmul(layer.o, "attn", "o")
                pending = "o"
            elif kind == "pending_norm":
                norm(pending, args[0], pending + "_normed")
                pending += "_normed"
            elif kind == "mlp":
                matmul(layer.gate_up, "h", "gate_up")
                op(gate, gate_up=ptr["gate_up"], inter=b["act"].shape[1], out=ptr["act"])
                matmul(layer.down, "act", "down")
                pending = "down"
            else:  # "scale", "moe": ``supports`` refuses such models
                raise ValueError(f"no native decode step for {kind!r}")
        return ops

    def _attend(self, op, i: int, threads: int) -> None:
        """Layer i's attention: q, k, v copied out of qkv, k and v written to the cache, the decode kernel."""
        model, cfg, b = self.model, self.model.config, self.buffers
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv, qkv_dim = b["qkv"].data_ptr(), b["qkv"].shape[1]
        offset = 0
        for name in ("q", "k", "v"):
            width = b[name].shape[1]
            op("copy_rows", src=qkv + 4 * offset, src_stride=qkv_dim, dst=b[name].data_ptr(), dst_stride=width,
               width=width)
            offset += width
        kv_group = self.kv_groups[i]
        for name, (kind, codes, code_stride, scales, scale_stride, rotation, levels) in zip(
                ("k", "v"), self.writer.layer_args[i]):
            op("kv_write", kv_group, kind=kind, x=b[name].data_ptr(), kv_heads=kv_heads, D=d, codes=codes,
               code_stride=code_stride, scales=scales, scale_stride=scale_stride, rotation=rotation,
               levels=levels)
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        op("paged_decode_attention", kv_group, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, q=b["q"].data_ptr(),
           out=b["attn"].data_ptr(), window=window or 0, scale=model.scale, softcap=cfg.attn_logit_softcap or 0.0,
           num_threads=threads, **self._attention_cache_args(i))

    def _attention_cache_args(self, layer: int) -> dict[str, int]:
        """paged_decode_attention's arguments that describe the KV cache of ``layer``, by name."""
        attention, parts = self.attention, self.attention.layer_args[layer]
        q_rotation, out_rotation = attention.rotation_args
        kv = {f"{side}_{field}": value for side, part in (("k", parts[:6]), ("v", parts[6:]))
              for field, value in zip(native_paged.KV_PART, part)}
        return dict(kv, num_blocks=attention.layer_num_blocks[layer], block_size=attention.block_size, q_rotation=q_rotation,
                    out_rotation=out_rotation)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: list[torch.Tensor],
                 context_lens: torch.Tensor, slot_rows: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions, context_lens [n] int64; per KV group, block_tables [n, max_blocks] int64
        (the same width in each group) and slot_rows [kv_heads * n] (``PagedKVStorage.slot_rows``).
        Returns the final hidden states [n, hidden]."""
        n = input_ids.shape[0]
        threads = torch.get_num_threads()
        if n > self.capacity or threads != self.threads:
            self._plan(max(n, 2 * self.capacity if n > self.capacity else self.capacity), threads)
        model, b = self.model, self.buffers
        x = model.embed_tokens(input_ids, out=b["x"][:n])
        if model.config.embedding_scale != 1.0:  # forward's multiply, in place
            x.mul_(torch.tensor(model.config.embedding_scale, dtype=x.dtype))
        max_position = int(positions.max())
        for rope, suffix in ((model.rope, ""), (model.rope_local, "_local")):
            if "cos" + suffix in b:
                cos, sin = rope.tables(positions, max_position)
                b["cos" + suffix][:n].copy_(cos.squeeze(1))
                b["sin" + suffix][:n].copy_(sin.squeeze(1))
        tables, rows = torch.stack(block_tables), torch.cat(slot_rows)  # one group after the other
        lens = context_lens.contiguous()
        failed = _step_function()(self.ops.data_ptr(), self.ops.shape[0], n, tables.data_ptr(), tables.stride(1),
                                  lens.data_ptr(), rows.data_ptr())
        if failed:
            raise MemoryError(f"native decode step: operation {failed - 1} could not allocate its workspace")
        self.calls += 1
        return self.buffers["out"][:n].clone()

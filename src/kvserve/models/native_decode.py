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
from kvserve.models.decoder import DecoderLM
from kvserve.models.linear import Int4Linear, Int8GroupLinear, StackedLinear
from kvserve.native.decode_ops import kernel_addresses, operation


@cache
def _step_function():
    return native.function("decode_step", "decode_step")


def _kernel_name(lin) -> str | None:
    """The native matmul a projection runs through ("stacked": each part its own), or None where it has
    none."""
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
        layer.moe is None and all(
            _kernel_name(lin) is not None for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
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
                  "down": hidden, "down_normed": hidden, "out": hidden, "cos": cfg.head_dim,
                  "sin": cfg.head_dim}
        if model.rope_local is not model.rope:
            widths |= {"cos_local": cfg.head_dim, "sin_local": cfg.head_dim}
        self.buffers = {name: torch.zeros(capacity, width) for name, width in widths.items()}
        self.ops = torch.tensor(self._operations(threads), dtype=torch.int64)
        self.capacity, self.threads = capacity, threads

    def _operations(self, threads: int) -> list[list[int]]:
        """The step's kernel calls over ``self.buffers``, each parameter named as kernels.h names it:
        ``DecoderLM.steps``, the list ``forward`` runs, each step as the kernels that do it."""
        ops = _StepOperations(self, threads)
        for kind, *args in self.model.steps:
            step = getattr(ops, "step_" + kind, None)
            if step is None:  # "scale", "moe": ``supports`` refuses such models
                raise ValueError(f"no native decode step for {kind!r}")
            step(*args)
        return ops.ops

    def attention_cache_args(self, layer: int) -> dict[str, int]:
        """paged_decode_attention's arguments that describe the KV cache of ``layer``, by name."""
        attention, parts = self.attention, self.attention.layer_args[layer]
        q_rotation, out_rotation = attention.rotation_args
        kv = {f"{side}_{field}": value for side, part in (("k", parts[:6]), ("v", parts[6:]))
              for field, value in zip(native_paged.KV_PART, part, strict=True)}
        return dict(kv, num_blocks=attention.layer_num_blocks[layer], block_size=attention.block_size,
                    q_rotation=q_rotation, out_rotation=out_rotation)

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
        failed = _step_function()(self.ops.data_ptr(), self.ops.shape[0], n, tables.data_ptr(),
                                  tables.stride(1), lens.data_ptr(), rows.data_ptr())
        if failed:
            raise MemoryError(f"native decode step: operation {failed - 1} could not allocate its workspace")
        self.calls += 1
        return self.buffers["out"][:n].clone()


class _StepOperations:
    """``DecoderLM.steps`` written as kernel calls, one method per kind of step (``step_<kind>``, taking
    the step's arguments). ``pending`` names the buffer holding the last block's output, which the next
    norm adds to the residual stream."""

    def __init__(self, owner: NativeDecodeStep, threads: int) -> None:
        self.owner, self.threads = owner, threads
        self.model, self.cfg, self.b = owner.model, owner.model.config, owner.buffers
        self.ptr = {name: t.data_ptr() for name, t in self.b.items()}
        self.fn = kernel_addresses()
        self.ops: list[list[int]] = []
        self.pending: str | None = None

    def op(self, kernel: str, kv_group: int = 0, **args) -> None:
        self.ops.append(operation(kernel, self.fn[kernel], kv_group, **args))

    def matmul(self, lin, x: str, y: str) -> None:
        """One operation a projection; a stacked one's parts each write their columns of y."""
        first = 0
        for part in lin.parts if isinstance(lin, StackedLinear) else [lin]:
            bias = None if part.bias is None else part.bias.data_ptr()
            kernel = _kernel_name(part)
            options = {"digits": part.digits, "layout": part.layout} if kernel == "int4_matmul" else {}
            self.op(kernel, x=self.ptr[x], w=part.packed.data_ptr(), bias=bias, N=part.out_features,
                    K=self.b[x].shape[1], y=self.ptr[y] + 4 * first, num_threads=self.threads,
                    ldy=self.b[y].shape[1], **options)
            first += part.out_features

    def norm(self, x: str, w: torch.Tensor, out: str) -> None:
        self.op("rms_norm", x=self.ptr[x], w=w.data_ptr(), eps=self.cfg.rms_norm_eps,
                hidden=self.cfg.hidden_size, out=self.ptr[out])

    def head_norm(self, first: int, count: int, w: torch.Tensor) -> None:
        d = self.cfg.head_dim
        self.op("rms_norm_heads", x=self.ptr["qkv"] + 4 * first * d, heads=count,
                token_stride=self.b["qkv"].shape[1], D=d, w=w.data_ptr(), eps=self.cfg.rms_norm_eps)

    def step_norm(self, w: torch.Tensor, final: bool) -> None:
        out = "out" if final else "h"
        if self.pending is None:
            self.norm("x", w, out)
            return
        self.op("add_rms_norm", x=self.ptr["x"], h=self.ptr[self.pending], h_is_bf16=0, w=w.data_ptr(),
                eps=self.cfg.rms_norm_eps, hidden=self.cfg.hidden_size, out=self.ptr[out])
        self.pending = None

    def step_qkv(self, i: int) -> None:
        self.matmul(self.model.layers[i].qkv, "h", "qkv")

    def step_qk_norm(self, i: int) -> None:
        layer = self.model.layers[i]
        self.head_norm(0, self.cfg.num_heads, layer.q_norm)
        self.head_norm(self.cfg.num_heads, self.cfg.num_kv_heads, layer.k_norm)

    def step_rope(self, i: int) -> None:
        model, cfg = self.model, self.cfg
        table = "_local" if cfg.is_sliding(i) and model.rope_local is not model.rope else ""
        self.op("rope_in_place", x=self.ptr["qkv"], heads=cfg.num_heads + cfg.num_kv_heads,
                token_stride=self.b["qkv"].shape[1], D=cfg.head_dim, cos=self.ptr["cos" + table],
                sin=self.ptr["sin" + table])

    def step_attend(self, i: int) -> None:
        """Layer i's attention: q, k, v copied out of qkv, k and v written to the cache, the decode kernel."""
        owner, cfg, b = self.owner, self.cfg, self.b
        kv_heads, d = cfg.num_kv_heads, cfg.head_dim
        offset = 0
        for name in ("q", "k", "v"):
            width = b[name].shape[1]
            self.op("copy_rows", src=self.ptr["qkv"] + 4 * offset, src_stride=b["qkv"].shape[1],
                    dst=self.ptr[name], dst_stride=width, width=width)
            offset += width
        kv_group = owner.kv_groups[i]
        for name, (kind, codes, code_stride, scales, scale_stride, rotation, levels) in zip(
                ("k", "v"), owner.writer.layer_args[i], strict=True):
            self.op("kv_write", kv_group, kind=kind, x=self.ptr[name], kv_heads=kv_heads, D=d, codes=codes,
                    code_stride=code_stride, scales=scales, scale_stride=scale_stride, rotation=rotation,
                    levels=levels)
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        self.op("paged_decode_attention", kv_group, num_heads=cfg.num_heads, num_kv_heads=kv_heads,
                head_dim=d, q=self.ptr["q"], out=self.ptr["attn"], window=window or 0, scale=self.model.scale,
                softcap=cfg.attn_logit_softcap or 0.0, num_threads=self.threads,
                **owner.attention_cache_args(i))

    def step_o(self, i: int) -> None:
        self.matmul(self.model.layers[i].o, "attn", "o")
        self.pending = "o"

    def step_pending_norm(self, w: torch.Tensor) -> None:
        self.norm(self.pending, w, self.pending + "_normed")
        self.pending += "_normed"

    def step_mlp(self, i: int) -> None:
        layer = self.model.layers[i]
        self.matmul(layer.gate_up, "h", "gate_up")
        gate = activations.GATE_KERNELS[self.cfg.hidden_act][1]
        self.op(gate, gate_up=self.ptr["gate_up"], inter=self.b["act"].shape[1], out=self.ptr["act"])
        self.matmul(layer.down, "act", "down")
        self.pending = "down"

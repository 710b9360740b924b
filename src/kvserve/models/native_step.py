"""A step of ``DecoderLM`` (prefill chunks and decodes, in any mix) in one native call
(``native/model_step.c``).

``DecoderLM.forward`` calls a C kernel, or a torch op, ~300 times a step; at one sequence and short
context that Python is ~3 ms of an ~8 ms decode step, and a prefill chunk's q/k/v are copied and
converted between the calls. ``NativeStep`` writes the same kernel calls once, as a list of operations
over activation buffers it owns, and a step becomes: the embedding rows, the RoPE rows, one call. The
arithmetic is the same calls with the same arguments, so the hidden states are the same bits as
``forward``'s (tested). The buffers are numpy arrays and a step calls no torch (tested): this is the step
the CPU runtime without torch runs; what torch still does for it happens at load (the weights, the KV
pool, the RoPE tables as they grow).

It covers what those kernels cover: decoders on the CPU in f32 whose projections all run through the
4-bit or int8 kernels (``--weights q4`` / ``q4-fast`` / ``int8``), SiLU or GELU gating, q/k norms per
head, post-norms, an embedding scale, a second RoPE table for sliding layers, soft-capped attention
scores (the Llama family, Qwen3, Gemma 2 and 3; Gemma 2's capped logits come after the step, in
``compute_logits``), and KV codecs the C writer and the attention kernels take (all but fp8; rotated
codecs' query rotation and value un-rotation happen inside the attention kernels).
``for_model`` returns None for anything else (partial rotary, residual multipliers, experts, other
weight formats, fp8 KV, no compiler), and the engine keeps ``forward``.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from kvserve import native
from kvserve.attention import native_paged
from kvserve.kv.storage import PagedKVStorage
from kvserve.lazy_torch import torch
from kvserve.models import activations, step_io
from kvserve.models.decoder import DecoderLM
from kvserve.models.linear import Int4Linear, Int8GroupLinear, StackedLinear
from kvserve.native import abi
from kvserve.native.step_ops import kernel_addresses, operation


@cache
def _step_function():
    return native.function("model_step", "model_step")


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
    """Whether every call of this model's step has a kernel (see the module's docstring)."""
    cfg = model.config
    native_matmuls = all(
        layer.moe is None and all(
            _kernel_name(lin) is not None for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        for layer in model.layers)
    head_norms = all(layer.q_norm is None or cfg.qk_norm_per_head for layer in model.layers)
    plain_config = (cfg.residual_scale == 1.0 and cfg.rotary_dim is None and not cfg.num_experts
                    and activations.gate_kernel(cfg.hidden_act) is not None)
    return (model.device.type == "cpu" and model.dtype_name == "float32" and native_matmuls and head_norms
            and plain_config)


def for_model(model: DecoderLM, storage: PagedKVStorage) -> NativeStep | None:
    """The one-call step for this model and KV cache, or None where it does not apply."""
    if not supports(model) or kernel_addresses() is None or _step_function() is None:
        return None
    attention = native_paged.for_storage(storage)
    writer = native_paged.writer_for_storage(storage)
    if attention is None or not isinstance(writer, native_paged.NativeKVWrite):
        return None
    if any(part is None for layer in writer.layer_args for part in layer):
        return None  # a codec the C writer does not take (fp8)
    return NativeStep(model, attention, writer, storage.kv_group_of_layer)


# A batch of decodes grows a row at a time: buffers double up to this many rows, so that it is not
# planned again at every new request; past it (prefill chunks) they are planned for the rows a step has,
# and kept for the next (the planner counts them: plan/planner.py's ``native_step_rows``).
DOUBLING_ROWS = 256


def rows_to_plan(n: int, capacity: int) -> int:
    """The rows to plan buffers for when a step has ``n`` rows (and the buffers ``capacity``)."""
    if n <= capacity:
        return capacity
    return max(n, min(2 * capacity, DOUBLING_ROWS))


class NativeStep:
    """Runs ``model.forward`` for a step's rows in one native call. Holds the KV cache's addresses (through
    the attention kernel's and the writer's argument packs), not the cache: its owner keeps both alive
    together."""

    def __init__(self, model: DecoderLM, attention: native_paged.NativePagedAttention,
                 writer: native_paged.NativeKVWrite, kv_groups: list[int] | None = None) -> None:
        self.model, self.attention, self.writer = model, attention, writer
        self.kv_groups = kv_groups or [0] * len(model.layers)  # per layer, its KV group
        self.num_kv_groups = max(self.kv_groups) + 1
        self.capacity = 0
        self.threads = -1
        self.calls = 0  # steps run (tests check the path was taken)
        self.prefill_calls = 0  # of which with prefill chunks
        self.embedding = step_io.embedding_lookup(model)
        self.head = step_io.HeadMatmul.for_model(model, _kernel_name)

    def _plan(self, capacity: int, threads: int) -> None:
        """Activation buffers for ``capacity`` rows and the operations over them."""
        model, cfg = self.model, self.model.config
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, inter = cfg.hidden_size, model.layers[0].gate_up.out_features // 2
        widths = {"x": hidden, "h": hidden, "qkv": q_dim + 2 * kv_dim, "q": q_dim, "k": kv_dim, "v": kv_dim,
                  "attn": q_dim, "q_decode": q_dim, "attn_decode": q_dim, "o": hidden, "o_normed": hidden,
                  "gate_up": 2 * inter, "act": inter, "down": hidden, "down_normed": hidden, "out": hidden,
                  "cos": cfg.head_dim, "sin": cfg.head_dim}
        if model.rope_local is not model.rope:
            widths |= {"cos_local": cfg.head_dim, "sin_local": cfg.head_dim}
        self.buffers = {name: np.zeros((capacity, width), np.float32) for name, width in widths.items()}
        self.ops = np.array(self._operations(threads), dtype=np.int64)
        self.capacity, self.threads = capacity, threads

    def _operations(self, threads: int) -> list[list[int]]:
        """The step's kernel calls over ``self.buffers``, each parameter named as kernels.h names it:
        ``DecoderLM.steps``, the list ``forward`` runs, each step as the kernels that do it."""
        ops = _StepOperations(self, threads)
        for kind, *args in self.model.steps:
            step = getattr(ops, "step_" + kind, None)
            if step is None:  # "scale", "moe": ``supports`` refuses such models
                raise ValueError(f"no native step for {kind!r}")
            step(*args)
        return ops.ops

    def attention_cache_args(self, layer: int) -> dict[str, int]:
        """The attention kernels' arguments that describe the KV cache of ``layer``, by name (with the
        query's rotation and the output's un-rotation of rotated codecs)."""
        attention, parts = self.attention, self.attention.layer_args[layer]
        q_rotation, out_rotation = attention.rotation_args
        q_balance = attention.balance_args[layer]
        kv = {f"{side}_{field}": value for side, part in (("k", parts[:6]), ("v", parts[6:]))
              for field, value in zip(native_paged.KV_PART, part, strict=True)}
        return dict(kv, num_blocks=attention.layer_num_blocks[layer], block_size=attention.block_size,
                    q_balance=q_balance, q_rotation=q_rotation, out_rotation=out_rotation)

    def __call__(self, input_ids: np.ndarray, positions: np.ndarray, slot_rows: list[np.ndarray],
                 decodes: StepDecodes | None = None, sequences: list[StepSequence] = ()) -> np.ndarray:
        """input_ids, positions [n] int64; per KV group, slot_rows [kv_heads * n]
        (``PagedKVStorage.slot_rows``); the rows that are decodes and the prefill chunks, which together
        are every row. Returns the final hidden states [n, hidden] f32 (a copy: the buffers are reused)."""
        n = input_ids.shape[0]
        threads = native.num_threads()
        if n > self.capacity or threads != self.threads:
            self._plan(rows_to_plan(n, self.capacity), threads)
        model, b = self.model, self.buffers
        x = self.embedding(input_ids, b["x"][:n])
        if model.config.embedding_scale != 1.0:  # forward's multiply (f32 by an f32 scalar), in place
            x *= np.float32(model.config.embedding_scale)
        max_position = int(positions.max())
        for rope, suffix in ((model.rope, ""), (model.rope_local, "_local")):
            if "cos" + suffix in b:
                rope.rows_into(positions, max_position, b["cos" + suffix][:n], b["sin" + suffix][:n])
        batch, tables, lens, sequence_tables = self._batch(decodes, sequences)
        rows = np.ascontiguousarray(np.concatenate(slot_rows), dtype=np.int64)  # one group after the other
        failed = _step_function()(self.ops.ctypes.data, self.ops.shape[0], n, batch.ctypes.data,
                                  tables.ctypes.data, tables.shape[2], lens.ctypes.data, rows.ctypes.data,
                                  sequence_tables.ctypes.data)
        if failed:
            raise MemoryError(f"native step: operation {failed - 1} could not allocate its workspace")
        self.calls += 1
        self.prefill_calls += bool(sequences)
        return b["out"][:n].copy()

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """``DecoderLM.compute_logits`` of hidden [m, hidden] f32, as f32 [m, vocab]: the head's kernels
        with the addresses taken when the step was made (the same calls ``compute_logits`` makes, so the
        same bits); torch's ``compute_logits`` for a head without one or a model that divides or caps its
        logits."""
        if self.head is not None:
            return self.head(hidden)
        return self.model.compute_logits(torch.from_numpy(np.ascontiguousarray(hidden))).numpy()

    def _batch(self, decodes: StepDecodes | None, sequences: list[StepSequence]) -> tuple[np.ndarray, ...]:
        """model_step's batch words, the decodes' block tables [groups, decodes, width] (padded with block
        0) and context lengths, and the chunks' block tables [groups, words] (each chunk's padded to its
        longest group's)."""
        constants = abi.header().constants
        groups = self.num_kv_groups
        decode_rows = decodes.rows if decodes is not None else []
        words = [len(decode_rows), len(sequences), 0, *decode_rows]
        offset = 0
        for s in sequences:
            words += [s.first_row, s.rows, s.position, offset]
            offset += max(len(t) for t in s.tables)
        words[constants["BATCH_TABLE_WORDS"]] = offset
        sequence_tables = np.zeros((groups, max(offset, 1)), dtype=np.int64)
        at = 0
        for s in sequences:
            for g, table in enumerate(s.tables):
                sequence_tables[g, at : at + len(table)] = table
            at += max(len(t) for t in s.tables)
        if decodes is None or not decode_rows:
            return (np.array(words, dtype=np.int64), np.zeros((groups, 0, 1), dtype=np.int64),
                    np.zeros(1, dtype=np.int64), sequence_tables)
        width = max(len(t) for g in decodes.tables for t in g)
        tables = np.zeros((groups, len(decode_rows), width), dtype=np.int64)
        for g, group in enumerate(decodes.tables):
            for i, table in enumerate(group):
                tables[g, i, : len(table)] = table
        return (np.array(words, dtype=np.int64), tables, np.asarray(decodes.context_lens, dtype=np.int64),
                sequence_tables)


class StepDecodes:
    """The decode rows of a step: each row's index, its block table per KV group ([group][decode]), its
    context length (its position + 1)."""

    __slots__ = ("context_lens", "rows", "tables")

    def __init__(self, rows: list[int], tables: list[list[list[int]]], context_lens: list[int]) -> None:
        self.rows, self.tables, self.context_lens = rows, tables, context_lens


class StepSequence:
    """A prefill chunk of a step: its first row, its rows, the position of its first row, and the blocks
    of positions [0, position + rows) per KV group."""

    __slots__ = ("first_row", "position", "rows", "tables")

    def __init__(self, first_row: int, rows: int, position: int, tables: list[list[int]]) -> None:
        self.first_row, self.rows, self.position, self.tables = first_row, rows, position, tables


class _StepOperations:
    """``DecoderLM.steps`` written as kernel calls, one method per kind of step (``step_<kind>``, taking
    the step's arguments). ``pending`` names the buffer holding the last block's output, which the next
    norm adds to the residual stream."""

    def __init__(self, owner: NativeStep, threads: int) -> None:
        self.owner, self.threads = owner, threads
        self.model, self.cfg, self.b = owner.model, owner.model.config, owner.buffers
        self.ptr = {name: a.ctypes.data for name, a in self.b.items()}
        self.fn = kernel_addresses()
        self.ops: list[list[int]] = []
        self.pending: str | None = None

    def op(self, kernel: str, kv_group: int = 0, **args) -> None:
        self.ops.append(operation(kernel, self.fn[kernel], kv_group, **args))

    def matmul(self, lin, x: str, y: str) -> None:
        """One operation a projection; a stacked one's parts each write their columns of y."""
        first = 0
        for part in lin.parts if isinstance(lin, StackedLinear) else [lin]:
            bias = None if part.bias is None else part.bias.ctypes.data
            kernel = _kernel_name(part)
            options = {"digits": part.digits, "layout": part.layout} if kernel == "int4_matmul" else {}
            self.op(kernel, x=self.ptr[x], w=part.packed.ctypes.data, bias=bias, N=part.out_features,
                    K=self.b[x].shape[1], y=self.ptr[y] + 4 * first, num_threads=self.threads,
                    ldy=self.b[y].shape[1], **options)
            first += part.out_features

    def norm(self, x: str, w: np.ndarray, out: str) -> None:
        self.op("rms_norm", x=self.ptr[x], w=w.ctypes.data, eps=self.cfg.rms_norm_eps,
                hidden=self.cfg.hidden_size, out=self.ptr[out])

    def head_norm(self, first: int, count: int, w: np.ndarray) -> None:
        d = self.cfg.head_dim
        self.op("rms_norm_heads", x=self.ptr["qkv"] + 4 * first * d, heads=count,
                token_stride=self.b["qkv"].shape[1], D=d, w=w.ctypes.data, eps=self.cfg.rms_norm_eps)

    def step_norm(self, w: np.ndarray, final: bool) -> None:
        out = "out" if final else "h"
        if self.pending is None:
            self.norm("x", w, out)
            return
        self.op("add_rms_norm", x=self.ptr["x"], h=self.ptr[self.pending], h_is_bf16=0, w=w.ctypes.data,
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
        """Layer i's attention: q, k, v copied out of qkv, k and v written to the cache; the prefill
        chunks attended row by row in place, the decodes' queries gathered, attended together and
        scattered back."""
        owner, cfg, b = self.owner, self.cfg, self.b
        kv_heads, d = cfg.num_kv_heads, cfg.head_dim
        offset = 0
        for name in ("q", "k", "v"):
            width = b[name].shape[1]
            self.op("copy_rows", src=self.ptr["qkv"] + 4 * offset, src_stride=b["qkv"].shape[1],
                    dst=self.ptr[name], dst_stride=width, width=width)
            offset += width
        kv_group = owner.kv_groups[i]
        for name, (kind, codes, code_stride, scales, scale_stride, rotation, levels, centre, balance) in zip(
                ("k", "v"), owner.writer.layer_args[i], strict=True):
            self.op("kv_write", kv_group, kind=kind, x=self.ptr[name], kv_heads=kv_heads, D=d, codes=codes,
                    code_stride=code_stride, scales=scales, scale_stride=scale_stride, rotation=rotation,
                    levels=levels, centre=centre, balance=balance)
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        shape = {"num_heads": cfg.num_heads, "num_kv_heads": kv_heads, "head_dim": d, "window": window or 0,
                 "scale": self.model.scale, "softcap": cfg.attn_logit_softcap or 0.0,
                 "num_threads": self.threads}
        cache = owner.attention_cache_args(i)
        self.op("paged_prefill_attention", kv_group, q=self.ptr["q"], out=self.ptr["attn"], **shape, **cache)
        width = b["q"].shape[1]
        rows = {"src_stride": width, "dst_stride": width, "width": width}
        self.op("gather_rows", src=self.ptr["q"], dst=self.ptr["q_decode"], **rows)
        self.op("paged_decode_attention", kv_group, q=self.ptr["q_decode"], out=self.ptr["attn_decode"],
                **shape, **cache)
        self.op("scatter_rows", src=self.ptr["attn_decode"], dst=self.ptr["attn"], **rows)

    def step_o(self, i: int) -> None:
        self.matmul(self.model.layers[i].o, "attn", "o")
        self.pending = "o"

    def step_pending_norm(self, w: np.ndarray) -> None:
        self.norm(self.pending, w, self.pending + "_normed")
        self.pending += "_normed"

    def step_mlp(self, i: int) -> None:
        layer = self.model.layers[i]
        self.matmul(layer.gate_up, "h", "gate_up")
        gate = activations.GATE_KERNELS[self.cfg.hidden_act][1]
        self.op(gate, gate_up=self.ptr["gate_up"], inter=self.b["act"].shape[1], out=self.ptr["act"])
        self.matmul(layer.down, "act", "down")
        self.pending = "down"


"""One decoder-only transformer forward for every architecture, switched by ``ModelConfig`` fields
(``models.arch`` says which architecture sets which).

llama / SmolLM2 / Mistral: RMSNorm, RoPE, GQA attention, SwiGLU. The others switch on: q/k/v bias
(qwen2), q/k norms per head (qwen3, gemma3) or over the projection (olmoe), post-norms, GELU,
embedding scaling and sliding-window layers (gemma), partial rotary (phi3), residual and logit
multipliers (granite), soft-capped attention scores and logits (gemma2), and a mixture-of-experts
MLP (qwen3moe, olmoe). Fused files (phi3's qkv and gate_up) load as the fused projections they are.

The forward takes a flat batch of tokens from any number of sequences, their explicit positions,
and an ``AttentionBackend`` that owns the KV cache: it stores this step's k/v and attends over
each sequence's history. The model itself holds no per-request state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.config import ModelConfig
from kvserve.host_memory import packing_arena
from kvserve.models import file_linears
from kvserve.models.activations import gated
from kvserve.models.gguf_file import GGUFWeights
from kvserve.models.linear import Int8GroupLinear, Linear, make_linear, pack_into_arena
from kvserve.models.moe import MoE
from kvserve.models.norms import add_rms_norm, rms_norm, rms_norm_heads
from kvserve.models.rope import RotaryEmbedding, inverse_frequencies, rotary_embedding, rotate_heads
from kvserve.models.weight_grids import int8_groups16


class AttentionBackend(Protocol):
    """Stores k/v of this step's tokens in the cache and returns attention outputs."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]. ``softcap``: scores s -> softcap * tanh(s / softcap)
        before the softmax (Gemma 2); None or 0: none."""
        ...


@dataclass(slots=True)
class LayerWeights:
    """Norm weights as tensors; projections as ``Linear`` callables (see ``models.linear``)."""

    attn_norm: torch.Tensor
    qkv: Linear  # hidden -> q_dim + 2 * kv_dim: q, k, v stacked (with qwen2's bias)
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None  # hidden -> 2 * intermediate: gate then up (None: the layer's MLP is ``moe``)
    down: Linear | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    moe: MoE | None = None

    @property
    def linears(self) -> list[Linear]:
        experts = [] if self.moe is None else self.moe.gate_up + self.moe.down
        return [lin for lin in (self.qkv, self.o, self.gate_up, self.down) if lin is not None] + experts


class DecoderLM:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        weight_format: str = "f32",
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.weight_format = weight_format

        self._weights = weights
        self._from_file = file_linears.applies(weights, weight_format, device, dtype)
        self.final_norm = self._w("output_norm.weight")
        # every packed weight straight into one 2 MiB-page region (host_memory.PackingArena), sized for the
        # worst widening (4-bit blocks as int8 groups: 2x); what the model leaves unused stays virtual
        capacity = 2 * sum(t.num_bytes for t in weights.gf.tensors.values()) if self._from_file else 0
        with packing_arena(capacity):
            self._head_and_embedding(weights)
            self.layers = [self._layer(f"blk.{i}.") for i in range(config.num_layers)]
            # a head built from the file's grid already sits in its own 2 MiB-page buffer
            head = [] if self._head_from_grid else [self.lm_head]
            pack_into_arena(head + [lin for layer in self.layers for lin in layer.linears])
        self.rope = rotary_embedding(config, weights, device, dtype)
        self.rope_local = self.rope
        if config.rope_theta_local is not None:
            self.rope_local = RotaryEmbedding(inverse_frequencies(config, config.rope_theta_local), device,
                                              dtype)
        self.scale = config.attn_scale or config.head_dim**-0.5
        self.q_dim = config.num_heads * config.head_dim
        self.kv_dim = config.num_kv_heads * config.head_dim
        del self._weights  # the loader's dict: not kept past the load

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return make_linear(weight, bias, self.weight_format, self.device, self.dtype)

    def _w(self, name: str) -> torch.Tensor:
        # popped so each source tensor is freed as soon as its (fused) copy exists: the load never holds
        # the weights twice
        return self._weights.pop(name).to(device=self.device, dtype=self.dtype)

    def _opt(self, name: str) -> torch.Tensor | None:
        return self._w(name) if name in self._weights else None

    def _projection(self, names: list[str], bias: torch.Tensor | None = None) -> Linear:
        """The tensors ``names`` stacked as one projection: from the file's blocks where they allow
        (``file_linears``), else through f32; where the file states the grid of one of them
        (``GGUFWeights.grid16``), the stacked grid, so the int8 groups can hold every part exactly."""
        weights = self._weights
        held = file_linears.projection(weights, names, bias, self.weight_format) if self._from_file else None
        if held is not None:
            return held
        stated = [weights.grid16(n) if hasattr(weights, "grid16") else None for n in names]
        parts = [self._w(n) for n in names]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)

        def stacked_grid() -> tuple[torch.Tensor, ...] | None:
            grids = [g() if g is not None else int8_groups16(p) for g, p in zip(stated, parts, strict=True)]
            if not all(g is not None for g in grids):
                return None
            return tuple(torch.cat(t) for t in zip(*grids, strict=True))

        grid16 = stacked_grid if any(g is not None for g in stated) else None
        return make_linear(weight, bias, self.weight_format, self.device, self.dtype, grid16)

    def _head_and_embedding(self, weights) -> None:
        """The head and the embedding table from the file's blocks where the format allows: a tied block
        type (Q4_0 ... Q6_K) as its own layout with the table kept as the file's bytes (QuantRows), a
        tied Q8_0 table as the int8 head (rows from it), an untied table as the file's bytes beside it;
        else the f32 table and a head in the model's format."""
        tied = "output.weight" not in weights
        self.embed, self.embed_rows, self.lm_head = None, None, None
        if tied:
            if self._from_file:  # a block type: its own layout, rows from the file's bytes
                found = file_linears.tied_head(weights, self.weight_format)
                self.lm_head, self.embed_rows = found or (None, None)
            if self.lm_head is None:
                self.lm_head = self._tied_int8_head(weights)
        elif self._from_file:
            self.embed_rows = weights.quant_rows("token_embd.weight")
            self.lm_head = file_linears.projection(weights, ["output.weight"], None, self.weight_format)
        self._head_from_grid = self.lm_head is not None  # in its own 2 MiB-page buffer already
        if self.lm_head is None:
            if self.embed_rows is None:
                self.embed = self._w("token_embd.weight")  # [vocab, hidden]
            self.lm_head = self._linear(self.embed if tied else self._w("output.weight"))
            if tied and isinstance(self.lm_head, Int8GroupLinear) and self.lm_head.holds(self.embed):
                self.embed = None  # the head's groups hold the embedding exactly: the f32 copy goes

    def _tied_int8_head(self, weights) -> Int8GroupLinear | None:
        """The tied head as int8 groups repacked from the file's blocks where the format holds the head as
        int8 groups and the embedding is a Q8_0 (Q5_0, Q4_0) tensor; else None."""
        if self.weight_format not in ("int8", "q4", "q4-fast") or self.device.type != "cpu":
            return None
        if not isinstance(weights, GGUFWeights) or self.dtype != torch.float32:
            return None
        return file_linears.int8_groups(weights, ["token_embd.weight"], None)

    def _layer(self, p: str) -> LayerWeights:
        """Layer ``p``'s weights by their GGUF names: q, k, v stacked (or the file's fused attn_qkv), gate
        and up stacked (or phi3's fused ffn_up), or the experts of a mixture."""
        bias = None
        if p + "attn_q.bias" in self._weights:
            bias = torch.cat([self._w(p + "attn_q.bias"), self._w(p + "attn_k.bias"),
                              self._w(p + "attn_v.bias")])
        fused_qkv = p + "attn_qkv.weight" in self._weights
        qkv = [p + "attn_qkv.weight"] if fused_qkv else [p + "attn_q.weight", p + "attn_k.weight",
                                                         p + "attn_v.weight"]
        layer = LayerWeights(
            attn_norm=self._w(p + "attn_norm.weight"),
            qkv=self._projection(qkv, bias),
            o=self._projection([p + "attn_output.weight"]),
            ffn_norm=self._w(p + "ffn_norm.weight"),
            gate_up=None,
            down=None,
            q_norm=self._opt(p + "attn_q_norm.weight"),
            k_norm=self._opt(p + "attn_k_norm.weight"),
            post_attn_norm=self._opt(p + "post_attention_norm.weight"),
            post_ffn_norm=self._opt(p + "post_ffw_norm.weight"),
        )
        if self.config.num_experts:
            layer.moe = self._experts(p)
            return layer
        fused_gate_up = p + "ffn_gate.weight" not in self._weights  # phi3: ffn_up holds gate then up
        layer.gate_up = self._projection(
            [p + "ffn_up.weight"] if fused_gate_up else [p + "ffn_gate.weight", p + "ffn_up.weight"])
        layer.down = self._projection([p + "ffn_down.weight"])
        return layer

    def _experts(self, p: str) -> MoE:
        """The router (f32) and each expert's gate_up and down in the model's weight format, from the
        stacked [experts, out, in] tensors (GGUF's *_exps; the HF loader stacks its per-expert tensors)."""
        cfg = self.config
        router = self._weights.pop(p + "ffn_gate_inp.weight").to(self.device, torch.float32)
        gate, up = self._w(p + "ffn_gate_exps.weight"), self._w(p + "ffn_up_exps.weight")
        gate_up = [self._linear(torch.cat([gate[e], up[e]])) for e in range(cfg.num_experts)]
        del gate, up
        down_all = self._w(p + "ffn_down_exps.weight")
        down = [self._linear(down_all[e]) for e in range(cfg.num_experts)]
        return MoE(router, gate_up, down, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act)

    def embed_tokens(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding rows of input_ids [num_tokens] (into out when given): from the f32 table, or from
        the tied int8 head that holds it exactly."""
        if self.embed is not None:
            return torch.index_select(self.embed, 0, input_ids,
                                      out=out) if out is not None else self.embed[input_ids]
        if self.embed_rows is not None:
            return self.embed_rows.rows(input_ids, out).to(self.dtype)
        if out is not None and out.dtype == torch.float32 and out.is_contiguous():
            return self.lm_head.rows(input_ids, out)
        rows = self.lm_head.rows(input_ids).to(self.dtype)
        return rows if out is None else out.copy_(rows)

    def fit_context(self, num_ctx: int) -> None:
        """Every rotary table (Gemma's sliding layers have their own) fitted to the context served
        (``RotaryEmbedding.fit_context``)."""
        self.rope.fit_context(num_ctx)
        if self.rope_local is not self.rope:
            self.rope_local.fit_context(num_ctx)

    @functools.cached_property
    def steps(self) -> list[tuple]:
        """The decoder's operations in order, the one place the order is written: ``forward`` runs them
        in torch, ``native_decode.NativeDecodeStep`` as native kernel calls. A block's output is held
        apart ("pending") until the next norm adds it to the residual stream:

            ("norm", w, last)      add the pending output (if any) to the residual stream, RMS-normalize
                                   it by w (``last``: the final norm, whose result the model returns)
            ("qkv", i)             layer i's fused q, k, v projection of the normalized stream
            ("qk_norm", i)         RMSNorm of q and k (per head, or over all heads)
            ("rope", i)            q and k rotated (a sliding layer's with the local table)
            ("attend", i)          attention over the cache (a sliding layer within its window)
            ("o", i)               the output projection: the pending output
            ("pending_norm", w)    RMSNorm of the pending output (Gemma's post-norms)
            ("scale",)             the pending output times ``residual_scale`` (Granite)
            ("mlp", i)             gate_up, the gate, down of the normalized stream: the pending output
            ("moe", i)             the experts instead
        """
        cfg, steps = self.config, []
        scale = [("scale",)] if cfg.residual_scale != 1.0 else []
        for i, layer in enumerate(self.layers):
            steps += [("norm", layer.attn_norm, False), ("qkv", i)]
            steps += [("qk_norm", i)] if layer.q_norm is not None else []
            steps += [("rope", i), ("attend", i), ("o", i)]
            steps += [("pending_norm", layer.post_attn_norm)] if layer.post_attn_norm is not None else []
            steps += scale + [("norm", layer.ffn_norm, False), ("moe" if layer.moe is not None else "mlp", i)]
            steps += [("pending_norm", layer.post_ffn_norm)] if layer.post_ffn_norm is not None else []
            steps += scale
        return steps + [("norm", self.final_norm, True)]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns final hidden states [num_tokens, hidden]."""
        cfg = self.config
        n = input_ids.shape[0]
        x = self.embed_tokens(input_ids)
        if cfg.embedding_scale != 1.0:
            x = x * torch.tensor(cfg.embedding_scale, dtype=x.dtype, device=x.device)
        max_pos = int(positions.max()) if n else 0
        rope_tables = self.rope.tables(positions, max_pos)
        local_tables = rope_tables
        if self.rope_local is not self.rope:
            local_tables = self.rope_local.tables(positions, max_pos)
        run = _ForwardPass(self, x, rope_tables, local_tables, attn)
        for kind, *args in self.steps:
            getattr(run, "step_" + kind)(*args)
        return run.h

    def _qk_norm(self, layer: LayerWeights, qkv: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """RMSNorm of q and k per head (head_dim weights; in place where the kernel runs), or over all
        heads at once (olmoe)."""
        eps, n = self.config.rms_norm_eps, qkv.shape[0]
        if self.config.qk_norm_per_head:
            qkv = rms_norm_heads(qkv, 0, heads[0], layer.q_norm, eps)
            return rms_norm_heads(qkv, heads[0], heads[1], layer.k_norm, eps)
        q, k, v = qkv.split(heads, dim=1)
        q = rms_norm(q.reshape(n, -1), layer.q_norm, eps).view(q.shape)
        k = rms_norm(k.reshape(n, -1), layer.k_norm, eps).view(k.shape)
        return torch.cat([q, k, v], 1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_seqs, hidden] -> float32 logits [num_seqs, vocab] (granite's divided, gemma2's
        soft-capped)."""
        logits = self.lm_head(hidden).float()
        cfg = self.config
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits


class _ForwardPass:
    """One ``DecoderLM.forward``'s working values and its steps in torch, one method per kind of step
    (``step_<kind>``, taking the step's arguments; ``DecoderLM.steps`` says what each does):
    the residual stream ``x``, its normalized ``h``, the layer's q/k/v and attention output, and
    ``pending``, the last block's output, which the next norm adds to the stream."""

    def __init__(self, model: DecoderLM, x: torch.Tensor, rope_tables: tuple, local_tables: tuple,
                 attn: AttentionBackend) -> None:
        self.model, self.cfg, self.attn = model, model.config, attn
        self.x, self.n, self.rope_tables, self.local_tables = x, x.shape[0], rope_tables, local_tables
        self.heads = [self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.num_kv_heads]
        self.h = self.qkv = self.q = self.k = self.v = self.o = self.pending = None

    def step_norm(self, w: torch.Tensor, last: bool) -> None:
        eps = self.cfg.rms_norm_eps
        if self.pending is None:
            self.h = rms_norm(self.x, w, eps)
        else:
            self.x, self.h = add_rms_norm(self.x, self.pending, w, eps)
            self.pending = None

    def step_qkv(self, i: int) -> None:
        cfg = self.cfg
        self.qkv = self.model.layers[i].qkv(self.h).view(self.n, cfg.num_heads + 2 * cfg.num_kv_heads,
                                                         cfg.head_dim)

    def step_qk_norm(self, i: int) -> None:
        self.qkv = self.model._qk_norm(self.model.layers[i], self.qkv, self.heads)

    def step_rope(self, i: int) -> None:
        cos, sin = self.local_tables if self.cfg.is_sliding(i) else self.rope_tables
        # q and k in one go
        self.q, self.k, self.v = rotate_heads(self.qkv, self.heads[0] + self.heads[1], cos, sin).split(
            self.heads, dim=1)

    def step_attend(self, i: int) -> None:
        cfg = self.cfg
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        self.o = self.attn.attend(i, self.q, self.k, self.v, window, self.model.scale,
                                  cfg.attn_logit_softcap or None)

    def step_o(self, i: int) -> None:
        self.pending = self.model.layers[i].o(self.o.reshape(self.n, self.model.q_dim))

    def step_pending_norm(self, w: torch.Tensor) -> None:
        self.pending = rms_norm(self.pending, w, self.cfg.rms_norm_eps)

    def step_scale(self) -> None:
        self.pending = self.pending * self.cfg.residual_scale

    def step_mlp(self, i: int) -> None:
        layer = self.model.layers[i]
        self.pending = layer.down(gated(layer.gate_up(self.h), self.cfg.hidden_act))

    def step_moe(self, i: int) -> None:
        self.pending = self.model.layers[i].moe(self.h)

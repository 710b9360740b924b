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
from typing import Protocol

import numpy as np

from kvserve.config import ModelConfig
from kvserve.lazy_torch import Device, as_numpy, dtype_name, inference_mode, torch, torch_dtype
from kvserve.models.activations import gated
from kvserve.models.decoder_weights import DecoderWeights, LayerWeights
from kvserve.models.key_balance import key_balance
from kvserve.models.norms import add_rms_norm, rms_norm, rms_norm_heads
from kvserve.models.rope import rotate_heads


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


class DecoderLM:
    """The forward of a decoder whose weights ``models.decoder_weights`` built: it holds and runs them,
    and loads nothing itself."""

    def __init__(self, config: ModelConfig, weights: DecoderWeights, device: Device, dtype: str,
                 weight_format: str = "f32") -> None:
        """dtype: the activations' element type by name ("float32"); ``dtype`` gives torch's."""
        self.config = config
        self.device = device
        self.dtype_name = dtype_name(dtype)
        self.weight_format = weight_format
        self.final_norm = weights.final_norm
        self.layers = weights.layers
        self.lm_head = weights.lm_head
        self.embed, self.embed_rows = weights.embed, weights.embed_rows
        self.rope, self.rope_local = weights.rope, weights.rope_local
        self.scale = config.attn_scale or config.head_dim**-0.5
        self.q_dim = config.num_heads * config.head_dim
        self.kv_dim = config.num_kv_heads * config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        """The activations' torch dtype (for torch code: the CPU runtime reads ``dtype_name``)."""
        return torch_dtype(self.dtype_name)

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

    def key_centres(self, span: int = 32768, max_angle: float = 3.0) -> list[np.ndarray | None] | None:
        """Per layer, the vector quantized keys are stored centred on ([kv_heads, head_dim] f32, see
        ``kv.storage``), or None for a layer without a K bias; None when no layer has one.

        A K bias is added before RoPE, so what it leaves in a stored key turns with the position, except
        on the pairs RoPE turns less than ``max_angle`` radians over ``span`` positions: there the bias
        is the centre, elsewhere 0. Qwen2.5's biases reach 145 there (layer 0) against keys of ~1-5,
        and cost q8_0 keys a KLD of 0.022 on pydoc text; centred (and rotated) 0.0003. Any fixed
        centre is exact for attention, so the choice only moves quantization error."""
        cfg, centres = self.config, []
        for i, layer in enumerate(self.layers):
            bias = getattr(layer.qkv, "bias", None)
            if bias is None or layer.k_norm is not None:  # a norm after the bias: nothing fixed to take out
                centres.append(None)
                continue
            k_bias = np.asarray(as_numpy(bias), dtype=np.float32)[self.q_dim : self.q_dim + self.kv_dim]
            inv_freq = (self.rope_local if cfg.is_sliding(i) else self.rope).inv_freq
            still = (inv_freq * span < max_angle).astype(np.float32)  # per pair (j, j + rotated / 2)
            keep = np.ones(cfg.head_dim, dtype=np.float32)  # dims past the rotated ones never turn
            keep[: 2 * len(still)] = np.concatenate([still, still])
            centres.append(k_bias.reshape(cfg.num_kv_heads, -1) * keep)
        return centres if any(c is not None for c in centres) else None

    def key_balance(self) -> list[np.ndarray | None] | None:
        """Per layer, the scales quantized keys are stored times (the queries divided by them), or None:
        see ``models.key_balance``."""
        return key_balance(self, self.key_centres())

    def key_transforms(self) -> dict[str, list[np.ndarray | None] | None]:
        """``PagedKVStorage``'s keyword arguments for quantized keys: their centres and balance (the
        balance is measured on the centred keys, so it takes the centres computed once here)."""
        centres = self.key_centres()
        return {"key_centres": centres, "key_balance": key_balance(self, centres)}

    @functools.cached_property
    def steps(self) -> list[tuple]:
        """The decoder's operations in order, the one place the order is written: ``forward`` runs them
        in torch, ``native_step.NativeStep`` as native kernel calls. A block's output is held
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

    @inference_mode
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

    @inference_mode
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

"""A decoder's weights, built once by the loader from whatever holds them: the norms, each layer's
projections in the model's weight format, the head, the embedding table and the rotary tables.
``DecoderLM`` only runs what this builds.

The source is a ``WeightSource``: a GGUF file's tensors (``models.gguf_file.GGUFWeights``) or a dict of
tensors (``TensorWeights``: an HF folder's). Where a file's blocks can be held as they are (an integer
weight format on the CPU in f32), the source hands over a ``FileLinears`` (``models.file_linears``) that
makes projections, the head and the table straight from the blocks; every weight it declines goes
through f32 (``models.linear.make_linear``), with the grid the file states where it states one.
Tensors are popped from the source as they are built, so a load never holds the weights twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np

from kvserve.config import ModelConfig
from kvserve.host_memory import packing_arena
from kvserve.lazy_torch import Device, as_numpy, dtype_name, torch, torch_dtype
from kvserve.models.linear import Int8GroupLinear, Linear, make_linear, pack_into_arena
from kvserve.models.moe import MoE
from kvserve.models.rope import RotaryEmbedding, inverse_frequencies, rotary_embedding
from kvserve.models.weight_grids import int8_groups16

if TYPE_CHECKING:
    from kvserve.models.file_linears import FileLinears
    from kvserve.models.gguf_file import QuantRows

Grid16 = Callable[[], tuple["torch.Tensor", ...]]


class WeightSource(Protocol):
    """Tensors by their GGUF names (an HF folder's are renamed to them on load)."""

    def __contains__(self, name: str) -> bool: ...

    def pop(self, name: str) -> torch.Tensor:
        """The tensor at f32, no longer held by the source."""
        ...

    def pop_array(self, name: str) -> np.ndarray:
        """``pop`` as a numpy f32 array."""
        ...

    def get_array(self, name: str) -> np.ndarray | None:
        """A tensor read as numbers rather than weights (RoPE's frequency factors) as f32 numpy, left in the
        source; None where the source has none of that name."""
        ...

    def grid16(self, name: str) -> Grid16 | None:
        """The grid the file states for the tensor, decoded when called (``GGUFWeights.grid16``)."""
        ...

    def file_linears(self, weight_format: str, device: Device,
                     dtype: str) -> FileLinears | None:
        """What makes weights straight from the file's blocks for this load; None: everything through f32."""
        ...


class TensorWeights:
    """A dict of tensors as a ``WeightSource``: no file blocks, no stated grids."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def pop(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)

    def pop_array(self, name: str) -> np.ndarray:
        return np.asarray(as_numpy(self.tensors.pop(name)), dtype=np.float32)

    def get_array(self, name: str) -> np.ndarray | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else np.asarray(as_numpy(tensor), dtype=np.float32)

    def grid16(self, name: str) -> Grid16 | None:
        return None

    def file_linears(self, weight_format: str, device: Device,
                     dtype: str) -> FileLinears | None:
        return None


Vector = Union[np.ndarray, "torch.Tensor"]  # a norm's weights (a string: naming it imports no torch)


@dataclass(slots=True)
class LayerWeights:
    """Norm weights as numpy f32 arrays for the CPU runtime, tensors on a device (``Vector``); projections
    as ``Linear`` callables (see ``models.linear``)."""

    attn_norm: Vector
    qkv: Linear  # hidden -> q_dim + 2 * kv_dim: q, k, v stacked (with qwen2's bias)
    o: Linear
    ffn_norm: Vector
    gate_up: Linear | None  # hidden -> 2 * intermediate: gate then up (None: the layer's MLP is ``moe``)
    down: Linear | None
    q_norm: Vector | None = None
    k_norm: Vector | None = None
    post_attn_norm: Vector | None = None
    post_ffn_norm: Vector | None = None
    moe: MoE | None = None

    @property
    def linears(self) -> list[Linear]:
        experts = [] if self.moe is None else self.moe.gate_up + self.moe.down
        return [lin for lin in (self.qkv, self.o, self.gate_up, self.down) if lin is not None] + experts


@dataclass(slots=True)
class DecoderWeights:
    final_norm: Vector
    layers: list[LayerWeights]
    lm_head: Linear
    embed: torch.Tensor | None  # the f32 table [vocab, hidden]; None where rows come from below
    embed_rows: QuantRows | None  # the table as the file's bytes; None: from ``embed`` or the head's groups
    rope: RotaryEmbedding
    rope_local: RotaryEmbedding  # the sliding layers' (gemma3's local theta), else ``rope``


def build_weights(config: ModelConfig, weights: WeightSource, device: Device, dtype: str,
                  weight_format: str = "f32") -> DecoderWeights:
    """Every weight of the decoder from ``weights``, in ``weight_format`` (``models.linear.WEIGHT_FORMATS``).
    A tensor the architecture needs and the source lacks is a ``KeyError`` naming it."""
    return _Builder(config, weights, device, dtype, weight_format).build()


class _Builder:
    def __init__(self, config: ModelConfig, weights: WeightSource, device: Device, dtype: str,
                 weight_format: str) -> None:
        self.config, self.weights = config, weights
        self.device, self.dtype, self.weight_format = device, dtype, weight_format
        self.held = weights.file_linears(weight_format, device, dtype)
        # the CPU runtime's f32 (the one-call step's): vectors as numpy arrays, which torch sees through
        self.host = device.type == "cpu" and dtype_name(dtype) == "float32"

    def build(self) -> DecoderWeights:
        config, weights = self.config, self.weights
        final_norm = self._norm("output_norm.weight")
        # every packed weight straight into one 2 MiB-page region (host_memory.PackingArena), sized for the
        # worst widening (4-bit blocks as int8 groups: 2x); what the model leaves unused stays virtual
        with packing_arena(0 if self.held is None else self.held.arena_bytes):
            lm_head, embed, embed_rows, head_from_grid = self._head_and_embedding()
            layers = [self._layer(f"blk.{i}.") for i in range(config.num_layers)]
            # a head built from the file's grid already sits in its own 2 MiB-page buffer
            head = [] if head_from_grid else [lm_head]
            pack_into_arena(head + [lin for layer in layers for lin in layer.linears])
        rope = rope_local = rotary_embedding(config, weights, self.device, self.dtype)
        if config.rope_theta_local is not None:
            rope_local = RotaryEmbedding(inverse_frequencies(config, config.rope_theta_local), self.device,
                                         self.dtype)
        return DecoderWeights(final_norm, layers, lm_head, embed, embed_rows, rope, rope_local)

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return make_linear(weight, bias, self.weight_format, self.device, self.dtype)

    def _w(self, name: str) -> torch.Tensor:
        return self.weights.pop(name).to(device=self.device, dtype=torch_dtype(self.dtype))

    def _norm(self, name: str) -> torch.Tensor | np.ndarray:
        """A norm's weight vector: numpy f32 for the CPU runtime, else a tensor on the device."""
        if not self.host:
            return self._w(name)
        return np.ascontiguousarray(self.weights.pop_array(name), dtype=np.float32)

    def _bias(self, names: list[str]) -> Vector:
        """The biases ``names`` stacked: numpy f32 for the CPU runtime (its kernels add them), else a
        tensor on the device."""
        if not self.host:
            return torch.cat([self._w(n) for n in names])
        return np.concatenate([self.weights.pop_array(n) for n in names]).astype(np.float32)

    def _opt_norm(self, name: str) -> torch.Tensor | np.ndarray | None:
        return self._norm(name) if name in self.weights else None

    def _projection(self, names: list[str], bias: torch.Tensor | None = None) -> Linear:
        """The tensors ``names`` stacked as one projection: from the file's blocks where they allow, else
        through f32; where the file states the grid of one of them, the stacked grid, so the int8 groups
        can hold every part exactly."""
        held = None if self.held is None else self.held.projection(names, bias)
        if held is not None:
            return held
        stated = [self.weights.grid16(n) for n in names]
        parts = [self._w(n) for n in names]
        weight = parts[0] if len(parts) == 1 else torch.cat(parts)

        def stacked_grid() -> tuple[torch.Tensor, ...] | None:
            grids = [g() if g is not None else int8_groups16(p) for g, p in zip(stated, parts, strict=True)]
            if not all(g is not None for g in grids):
                return None
            return tuple(torch.cat(t) for t in zip(*grids, strict=True))

        grid16 = stacked_grid if any(g is not None for g in stated) else None
        return make_linear(weight, bias, self.weight_format, self.device, self.dtype, grid16)

    def _head_and_embedding(self) -> tuple[Linear, torch.Tensor | None, QuantRows | None, bool]:
        """(head, f32 table, table as file bytes, whether the head came from the file): a tied block type
        (Q4_0 ... Q6_K) as its own layout with the table kept as the file's bytes, a tied Q8_0 table as
        the int8 head (rows from it), an untied table as the file's bytes beside it; else the f32 table
        and a head in the model's format."""
        held, weights = self.held, self.weights
        tied = "output.weight" not in weights
        embed = embed_rows = lm_head = None
        if held is not None and tied:
            lm_head, embed_rows = held.tied_head() or (None, None)
            if lm_head is None:
                lm_head = held.int8_head()
        elif held is not None:
            embed_rows = held.table("token_embd.weight")
            lm_head = held.projection(["output.weight"], None)
        if lm_head is not None:
            return lm_head, embed, embed_rows, True
        if embed_rows is None:
            embed = self._w("token_embd.weight")  # [vocab, hidden]
        lm_head = self._linear(embed if tied else self._w("output.weight"))
        if tied and isinstance(lm_head, Int8GroupLinear) and lm_head.holds(embed):
            embed = None  # the head's groups hold the embedding exactly: the f32 copy goes
        return lm_head, embed, embed_rows, False

    def _layer(self, p: str) -> LayerWeights:
        """Layer ``p``'s weights by their GGUF names: q, k, v stacked (or the file's fused attn_qkv), gate
        and up stacked (or phi3's fused ffn_up), or the experts of a mixture."""
        bias = None
        if p + "attn_q.bias" in self.weights:
            bias = self._bias([p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"])
        fused_qkv = p + "attn_qkv.weight" in self.weights
        qkv = [p + "attn_qkv.weight"] if fused_qkv else [p + "attn_q.weight", p + "attn_k.weight",
                                                         p + "attn_v.weight"]
        layer = LayerWeights(
            attn_norm=self._norm(p + "attn_norm.weight"),
            qkv=self._projection(qkv, bias),
            o=self._projection([p + "attn_output.weight"]),
            ffn_norm=self._norm(p + "ffn_norm.weight"),
            gate_up=None,
            down=None,
            q_norm=self._opt_norm(p + "attn_q_norm.weight"),
            k_norm=self._opt_norm(p + "attn_k_norm.weight"),
            post_attn_norm=self._opt_norm(p + "post_attention_norm.weight"),
            post_ffn_norm=self._opt_norm(p + "post_ffw_norm.weight"),
        )
        if self.config.num_experts:
            layer.moe = self._experts(p)
            return layer
        fused_gate_up = p + "ffn_gate.weight" not in self.weights  # phi3: ffn_up holds gate then up
        layer.gate_up = self._projection(
            [p + "ffn_up.weight"] if fused_gate_up else [p + "ffn_gate.weight", p + "ffn_up.weight"])
        layer.down = self._projection([p + "ffn_down.weight"])
        return layer

    def _experts(self, p: str) -> MoE:
        """The router (f32) and each expert's gate_up and down in the model's weight format, from the
        stacked [experts, out, in] tensors (GGUF's *_exps; the HF loader stacks its per-expert tensors)."""
        cfg = self.config
        router = self.weights.pop(p + "ffn_gate_inp.weight").to(self.device, torch.float32)
        gate, up = self._w(p + "ffn_gate_exps.weight"), self._w(p + "ffn_up_exps.weight")
        gate_up = [self._linear(torch.cat([gate[e], up[e]])) for e in range(cfg.num_experts)]
        del gate, up
        down_all = self._w(p + "ffn_down_exps.weight")
        down = [self._linear(down_all[e]) for e in range(cfg.num_experts)]
        return MoE(router, gate_up, down, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act)

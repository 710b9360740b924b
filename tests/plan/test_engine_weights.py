"""The planner's engine weight line: the bytes the loaded model holds, per weight format, from the tensor
table alone."""

from __future__ import annotations

import pytest

from kvserve.plan.engine_weights import engine_weight_bytes
from kvserve.plan.source import resolve_model


def held_bytes(model) -> int:
    """What a loaded DecoderLM keeps for its weights: packed or dense projections, the head, the
    embedding and every norm."""
    total = model.embed.numel() * model.embed.element_size() + model.lm_head.nbytes
    total += model.final_norm.numel() * model.final_norm.element_size()
    for layer in model.layers:
        total += sum(lin.nbytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        norms = (layer.attn_norm, layer.ffn_norm, layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_ffn_norm)
        total += sum(t.numel() * t.element_size() for t in norms if t is not None)
    return total


@pytest.mark.parametrize("fmt", ["q4", "int8"])
def test_smollm2_engine_weights_are_what_the_loaded_model_holds(smollm2_q4, fmt):
    """q4: 4-bit Q4_1 projections, the Q8_0 head as int8 groups, the f32 embedding: ~200 MiB, where every
    parameter at f32 (the line's former figure) is 513 MiB."""
    from kvserve.models.loader import load_model

    spec = resolve_model("smollm2")
    loaded = smollm2_q4 if fmt == "q4" else load_model("smollm2", weight_format=fmt)
    assert engine_weight_bytes(spec.tensors, spec.num_params, fmt, "float32") == held_bytes(loaded.model)
    assert engine_weight_bytes(spec.tensors, spec.num_params, "auto", "float32") == held_bytes(smollm2_q4.model)
    assert engine_weight_bytes(spec.tensors, spec.num_params, "f32", "float32") == 4 * spec.num_params


def test_a_fused_projection_is_4_bit_only_when_every_part_is_q4_1():
    """q/k/v are one matmul: a Q6_K v (llama.cpp's Q4_K_M mixes) makes all three int8 rows."""
    def tensors(v_type):
        return (("token_embd.weight", "Q8_0", (64, 100)), ("blk.0.attn_norm.weight", "F32", (64,)),
                ("blk.0.attn_q.weight", "Q4_1", (64, 64)), ("blk.0.attn_k.weight", "Q4_1", (64, 32)),
                ("blk.0.attn_v.weight", v_type, (64, 32)))

    embed_and_head = 64 * 100 * 4 + 112 * 2 * 34  # f32 embedding; tied head: 100 rows padded to 112, 2 groups
    norm = 64 * 4
    assert engine_weight_bytes(tensors("Q4_1"), 0, "q4", "float32") == embed_and_head + norm + 128 * 2 * 20
    assert engine_weight_bytes(tensors("Q6_K"), 0, "q4", "float32") == embed_and_head + norm + 128 * 64 + 4 * 128
    assert engine_weight_bytes(tensors("Q4_1"), 0, "int8", "float32") == embed_and_head + norm + 128 * 64 + 4 * 128
    assert engine_weight_bytes((), 1000, "q4", "bfloat16") == 2000  # no tensor table: every parameter at --dtype

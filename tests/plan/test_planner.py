"""Planner arithmetic: the seed figures, the engine's pool to the byte, windows, totals and fits."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.kv.cache_types import kv_bytes_per_token
from kvserve.plan.model_spec import resolve_model
from kvserve.plan.planner import (
    BPE_TOKENIZER_BYTES_PER_TOKEN,
    RUNTIME_OVERHEAD_BYTES,
    SPM_TOKENIZER_BYTES_PER_TOKEN,
    TOKENIZER_BYTES_PER_TOKEN,
    PlanSettings,
    activations,
    engine_pool,
    largest_fit,
    make_plan,
    planned_kv_pool_bytes,
    windowed_kv_bytes,
)
from kvserve.plan.presets import PRESETS
from tests.plan.helpers import llama


def test_seed_llama3_8b_fp16():
    config = PRESETS["Llama-3.1-8B"].config
    assert kv_bytes_per_token(config, "f16") == 131_072
    assert 131_072 * kv_bytes_per_token(config, "f16") == 17_179_869_184  # ~17.2 GB at 128K
    plan = make_plan(
        resolve_model("Llama-3.1-8B"),
        PlanSettings(contexts=(131072,), kv_types=(("f16", "f16"),), memory=1 << 40),
    )
    assert plan.kv[0].bytes_per_token == 131_072
    assert plan.kv[0].contexts[0].kv_bytes == plan.kv[0].contexts[0].engine_kv_pool_bytes == 17_179_869_184


def test_seed_llama3_70b_and_an_mha_7b():
    assert kv_bytes_per_token(PRESETS["Llama-3.1-70B"].config, "f16") == 327_680
    llama2_7b = llama(num_layers=32, num_kv_heads=32)  # multi-head attention: every head has its own K/V
    assert kv_bytes_per_token(llama2_7b, "f16") == 524_288


def _smollm2_config(path):
    from kvserve.models.gguf_config import read_model_config
    from kvserve.models.gguf_header import read_gguf_header

    return read_model_config(read_gguf_header(path))


@pytest.mark.parametrize("num_ctx, max_num_seqs, block_size", [(100, 3, 16), (64, 2, 16), (1, 1, 4)])
def test_planned_pool_is_what_the_engine_allocates(smollm2_path, num_ctx, max_num_seqs, block_size):
    import torch

    from kvserve.config import CacheConfig
    from kvserve.kv.pool_sizing import pool_size
    from kvserve.kv.storage import PagedKVStorage

    config = _smollm2_config(smollm2_path)
    num_blocks = pool_size(
        config, CacheConfig(block_size=block_size, num_ctx=num_ctx), max_num_seqs
    ).num_blocks
    for cache_type in ("f32", "f16", "bf16"):
        storage = PagedKVStorage(config, num_blocks, block_size, cache_type, torch.device("cpu"))
        assert storage.nbytes == planned_kv_pool_bytes(
            config, num_ctx, max_num_seqs, block_size, cache_type, cache_type
        ), cache_type


def test_planned_pool_matches_quantized_engine_storage(smollm2_path):
    import torch

    from kvserve.kv.storage import PagedKVStorage

    config = _smollm2_config(smollm2_path)
    for k, v in [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("fp8", "fp8"), ("tq3", "tq3"), ("q8_0", "tq2")]:
        storage = PagedKVStorage(config, 7, 16, k, torch.device("cpu"), v)
        assert storage.nbytes == planned_kv_pool_bytes(config, 7 * 16, 1, 16, k, v), (k, v)


def _gemma_style(**kw):
    """Three sliding layers (window 64) to one global, as Gemma 3's 5 to 1: small enough to allocate."""
    return llama(num_layers=4, num_kv_heads=2, head_dim=32, num_heads=4, sliding_window=64,
                 sliding_window_layers=(True, True, True, False), **kw)


@pytest.mark.parametrize(
    "num_ctx, max_num_seqs, max_num_batched_tokens, cache_type",
    [(1024, 2, 512, "f16"), (4096, 1, 64, "q8_0"), (300, 3, 32, "tq3"), (64, 1, 512, "f32"),
     (100, 4, 16, "f16")],
)
def test_planned_window_pool_is_what_the_engine_allocates(num_ctx, max_num_seqs, max_num_batched_tokens,
                                                          cache_type):
    import torch

    from kvserve.config import CacheConfig
    from kvserve.kv.pool_sizing import pool_size
    from kvserve.kv.storage import PagedKVStorage

    config = _gemma_style()
    for window_kv in (True, False):
        cache = CacheConfig(num_ctx=num_ctx, cache_type_k=cache_type, window_kv=window_kv)
        size = pool_size(config, cache, max_num_seqs, max_num_batched_tokens)
        storage = PagedKVStorage(config, size.num_blocks, 16, cache_type, torch.device("cpu"), None,
                                 size.window_layers, size.num_window_blocks)
        planned, planned_bytes = engine_pool(config, num_ctx, max_num_seqs, 16, cache_type, cache_type,
                                             max_num_batched_tokens, window_kv)
        assert planned == size and planned_bytes == storage.nbytes, window_kv
        every_token = -(-num_ctx // 16) * max_num_seqs * 16 * kv_bytes_per_token(config, cache_type)
        if not window_kv:
            assert planned_bytes == every_token  # every layer, every block
        elif num_ctx >= 1024:
            assert size.window_layers == {0, 1, 2} and planned_bytes < every_token
    assert not engine_pool(_gemma_style(), 64, 1, 16, "f16")[0].window_layers  # no smaller than every token


def test_the_plan_counts_the_engines_window_pool():
    gemma = PRESETS["Gemma-3-4B"].config  # 34 layers: 29 sliding (window 1024), 5 global; 4 KV heads x 256
    per_block_layer = 16 * 4 * 2 * 256 * 2  # tokens x kv_heads x (K + V) x head_dim x f16
    # 2 sequences' windows, one step of 256, the null block
    window_blocks = 2 * (1024 // 16 + 2) + 256 // 16 + 1
    size, nbytes = engine_pool(gemma, 131072, 2, 16, "f16", "f16", max_num_batched_tokens=256)
    assert (size.num_blocks, size.num_window_blocks, len(size.window_layers)) == (2 * 8192, window_blocks, 29)
    assert nbytes == (5 * 2 * 8192 + 29 * window_blocks) * per_block_layer
    assert windowed_kv_bytes(gemma, 131072, "f16") * 2 < nbytes  # the pool's windows hold a little more
    every_token = planned_kv_pool_bytes(gemma, 131072, 2, 16, "f16", window_kv=False)
    assert every_token == 34 * 2 * 8192 * per_block_layer
    all_sliding = PRESETS["Mistral-7B"].config  # no global layer to tie a window group to: every token
    assert planned_kv_pool_bytes(all_sliding, 32768, 1, 16, "f16") == 32768 * kv_bytes_per_token(
        all_sliding, "f16")


def test_sliding_layers_hold_their_window():
    gemma = PRESETS["Gemma-3-4B"].config  # 34 layers: 29 sliding (window 1024), 5 global
    per_layer_token = 4 * 2 * 256 * 2  # kv_heads x (K + V) x head_dim x f16
    assert windowed_kv_bytes(gemma, 500, "f16") == 34 * 500 * per_layer_token
    assert windowed_kv_bytes(gemma, 131072, "f16") == (29 * 1024 + 5 * 131072) * per_layer_token
    assert windowed_kv_bytes(PRESETS["Llama-3.1-8B"].config, 131072, "f16") == 17_179_869_184
    mistral = PRESETS["Mistral-7B"].config
    assert windowed_kv_bytes(mistral, 32768, "f16") == 4096 * kv_bytes_per_token(mistral, "f16")


def test_totals_add_up_and_differ_only_in_the_weights():
    spec = resolve_model("Gemma-3-12B")
    s = PlanSettings(contexts=(8192, 131072), kv_types=(("q8_0", "q8_0"),), memory=64 << 30, max_num_seqs=2)
    plan = make_plan(spec, s)
    # a preset has no tensor list: dequantized to float32
    assert plan.engine_weight_bytes == spec.num_params * 4
    overhead = RUNTIME_OVERHEAD_BYTES + TOKENIZER_BYTES_PER_TOKEN * spec.config.vocab_size
    assert plan.runtime_overhead == overhead
    for p in plan.kv[0].contexts:
        assert p.kv_bytes == p.ctx * plan.kv[0].bytes_per_token * 2
        assert p.kv_bytes_windowed < p.engine_kv_pool_bytes < p.kv_bytes  # the window pool, not every token
        assert p.engine_kv_pool_bytes == planned_kv_pool_bytes(spec.config, p.ctx, 2, 16, "q8_0", "q8_0")
        assert p.total == spec.stored_bytes + p.engine_kv_pool_bytes + p.activations.total + overhead
        assert p.engine_total == (
            plan.engine_weight_bytes
            + spec.mapped_bytes
            + p.engine_kv_pool_bytes
            + p.activations.total
            + overhead
        )


def test_activations_by_formula():
    c = llama(num_layers=32, num_kv_heads=8)  # hidden 4096, intermediate 16384, 32 heads x 128
    s = PlanSettings(contexts=(8192,), kv_types=(("f16", "f16"),), memory=1 << 40, attention="torch")
    a = activations(c, 8192, "f16", "f16", s)
    assert a.hidden_states == 512 * (4096 + 4096 + 2 * 1024 + 2 * 16384) * 4
    scores = 2 * 32 * 512 * 8192 * 4  # scores and softmax of one 512-query tile
    kernel_copies = 8192 * 3 * 32 * 128 * 4  # scaled K, and K and V repeated to 32 heads (GQA)
    gathered = 8192 * 8 * 2 * (256 + 128 * 4)  # f16 K and V of 8 heads, and their float32 copy
    assert (a.attention, a.attention_path) == (scores + kernel_copies + gathered, "prefill")
    assert a.logits == 32000 * 4
    many = activations(
        c, 8192, "f16", "f16",
        PlanSettings((8192,), (("f16", "f16"),), 1 << 40, max_num_seqs=64, attention="torch")
    )
    assert many.attention_path == "decode" and many.logits == 64 * 32000 * 4


def test_native_attention_plans_the_kernels_workspace_not_torchs_tiles():
    c = llama(num_layers=32, num_kv_heads=8)  # 32 heads x 128, groups of 4
    s = PlanSettings(contexts=(131072,), kv_types=(("f16", "f16"),), memory=1 << 40, attention="native",
                     threads=2)
    a = activations(c, 131072, "f16", "f16", s)
    prefill = 2 * (4 * (128 * 258 + 64 * 128 * 3) + 2 * (128 * 128 + 64 * 128) + 4 * (128 + 256))
    decode = 4 * 8 * 512 * 4 * 130 + 2 * 4 * (4 * 256 + 16 * 128) + 4 * 32 * 128  # 512 partitions of 256
    assert (a.attention, a.attention_path, a.attention_kernels) == (max(prefill, decode), "decode", "native")
    torch_path = activations(c, 131072, "f16", "f16", PlanSettings((131072,), (("f16", "f16"),), 1 << 40,
                                                                   attention="torch"))
    assert torch_path.attention > 20 * 2**30 > 1000 * a.attention  # Llama 3.1 8B at 128K: GiBs vs MiBs
    assert activations(c, 1024, "f16", "f16", s).attention < a.attention  # only decode states grow with ctx


def test_auto_attention_follows_the_engine(monkeypatch):
    from dataclasses import replace

    from kvserve import native
    from kvserve.plan.planner import attention_kernels

    c = llama(num_layers=2, num_kv_heads=8)
    s = PlanSettings((1024,), (("f16", "f16"),), 1 << 40)
    monkeypatch.setattr(native, "compiler", lambda: "cc")
    assert attention_kernels(c, s) == "native"
    assert attention_kernels(replace(c, attn_logit_softcap=50.0), s) == "native"  # gemma2's capped scores too
    monkeypatch.setenv("KVSERVE_NATIVE", "0")
    assert attention_kernels(c, s) == "torch"
    monkeypatch.delenv("KVSERVE_NATIVE")
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert attention_kernels(c, s) == "torch"


def test_largest_fit_is_exact():
    assert largest_fit(lambda n: 10 * n, 1000, 555) == 55
    assert largest_fit(lambda n: 10 * n, 1000, 10_000) == 1000  # capped by the model
    assert largest_fit(lambda n: 10 * n + 100, 1000, 50) == 0


def test_largest_context_fits_and_one_more_does_not():
    spec = resolve_model("Llama-3.1-8B")
    s = PlanSettings(contexts=(8192,), kv_types=(("f16", "f16"), ("tq3", "tq3")), memory=18 << 30,
                     attention="native")
    plan = make_plan(spec, s)
    f16, tq3 = plan.kv
    assert 0 < f16.max_ctx < tq3.max_ctx < 131072
    from kvserve.plan.planner import context_plan

    for t in plan.kv:
        assert (
            context_plan(spec, s, t.cache_type_k, t.cache_type_v, t.max_ctx, plan.engine_weight_bytes).total
            <= s.memory
        )
        assert (
            context_plan(
                spec, s, t.cache_type_k, t.cache_type_v, t.max_ctx + 1, plan.engine_weight_bytes
            ).total
            > s.memory
        )
    assert f16.engine_max_ctx == 0  # 30 GiB of float32 weights alone do not fit in 24 GiB


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="unknown KV cache type"):
        PlanSettings(contexts=(8192,), kv_types=(("f17", "f17"),), memory=1 << 30)
    with pytest.raises(ValueError, match="context lengths"):
        PlanSettings(contexts=(0,), kv_types=(("f16", "f16"),), memory=1 << 30)
    with pytest.raises(ValueError, match="max-num-seqs"):
        PlanSettings(contexts=(1,), kv_types=(("f16", "f16"),), memory=1 << 30, max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        PlanSettings(contexts=(1,), kv_types=(("f16", "f16"),), memory=1 << 30, dtype="int8")


def test_types_a_model_cannot_store_are_skipped_with_the_reason():
    spec = resolve_model("Llama-3.1-8B")
    odd = type(spec)(spec.name, llama(num_layers=2, num_kv_heads=2, head_dim=48), spec.source, 1, 2)
    plan = make_plan(
        odd, PlanSettings(contexts=(16,), kv_types=(("f16", "f16"), ("q8_0", "q8_0")), memory=1 << 40)
    )
    assert [t.name for t in plan.kv] == ["f16"]
    assert plan.skipped[0][0] == "q8_0" and "divisible by 32" in plan.skipped[0][1]


@pytest.mark.parametrize(("model", "pre", "per_token"), [
    ("gemma3-270m", None, SPM_TOKENIZER_BYTES_PER_TOKEN),
    ("smollm2", None, BPE_TOKENIZER_BYTES_PER_TOKEN),
    ("smollm2", "a-split-yet-unknown", TOKENIZER_BYTES_PER_TOKEN),  # not written out: the library's
])
def test_the_tokenizers_share_follows_its_kind(model, pre, per_token):
    """A SentencePiece vocabulary is the kernel's table (spm.py), a byte-level BPE one the kernel's tables
    (bpe.py) where it writes out the file's splits, else the `tokenizers` library's: the header tells
    which."""
    spec = resolve_model(model)
    assert spec.tokenizer_model == ("llama" if model.startswith("gemma") else "gpt2")
    if pre is not None:
        spec = dataclasses.replace(spec, tokenizer_pre=pre)
    s = PlanSettings(contexts=(1024,), kv_types=(("f16", "f16"),), memory=8 << 30)
    assert make_plan(spec, s).runtime_overhead == RUNTIME_OVERHEAD_BYTES + per_token * spec.config.vocab_size

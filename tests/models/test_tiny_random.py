"""Tiny random-weight qwen2 and llama models: our forward against transformers, fast (no real file).

Each model is built with transformers, its every parameter randomized (norm weights and q/k/v biases
included, with a spread wide enough that attention is far from uniform so RoPE and masking matter),
then handed to our loader in two forms:

* a Hugging Face folder written by ``save_pretrained`` (config.json + safetensors);
* a GGUF file written here with ``gguf.GGUFWriter``, laid out as llama.cpp's converter lays it out:
  GGUF tensor names, F32 data, and for the llama architecture (not qwen2) the Q/K rows permuted into
  llama.cpp's interleaved RoPE order, so that our loader's un-permute is exercised.

Non-default RoPE bases (1e6 for qwen2, 5e5 for llama, as the real families use) make sure the base is
read from the files rather than defaulted.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from kvserve.models.loader import load_model
from tests.models.arch_builders import byte_level_symbols, permute_like_llama_cpp
from tests.models.hf_reference import (
    LOGITS_RTOL,
    NEW_TOKENS,
    hf_greedy,
    hf_last_logits,
    our_greedy,
    our_last_logits,
    rel_err,
)

VOCAB = 256
HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
CONTEXT = 512
RMS_EPS = 1e-6

SPECS = {
    # qwen2: q/k/v biases, tied embeddings (as the small Qwen2.5 models), rope base 1e6
    "qwen2": {"arch": "qwen2", "rope_theta": 1_000_000.0, "tie": True, "scaling": None},
    # llama: untied output head, rope base 5e5
    "llama": {"arch": "llama", "rope_theta": 500_000.0, "tie": False, "scaling": None},
    # llama with Llama 3 RoPE frequency scaling (Llama 3.1/3.2); a short original context so that the
    # scaling changes most frequencies within the test prompts. The GGUF carries it as rope_freqs.weight.
    "llama3-scaled": {
        "arch": "llama",
        "rope_theta": 500_000.0,
        "tie": True,
        "scaling": {
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64
        },
    },
}


# --- helpers ----------------------------------------------------------------------------------------


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 40)]


def build_hf_model(name: str):
    spec = SPECS[name]
    arch = spec["arch"]
    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": RMS_EPS,
        "tie_word_embeddings": spec["tie"],
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    rope = {"rope_theta": spec["rope_theta"], "rope_type": "default"}
    legacy_scaling = {}
    if spec["scaling"]:
        rope = {"rope_theta": spec["rope_theta"], "rope_type": "llama3", **spec["scaling"]}
        legacy_scaling = {"rope_scaling": {"rope_type": "llama3", **spec["scaling"]}}
    if arch == "qwen2":
        Config, Model = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    else:
        Config, Model = transformers.LlamaConfig, transformers.LlamaForCausalLM
    try:
        config = Config(**common, rope_parameters=rope)  # transformers 5
    except TypeError:
        config = Config(**common, rope_theta=spec["rope_theta"], **legacy_scaling)  # transformers 4
    torch.manual_seed(0)
    model = Model(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in pname or "lm_head" in pname:
                p.copy_(torch.randn_like(p))
            else:  # projections: 1/sqrt(fan_in) * 2, so attention is peaky and logits are spread
                p.copy_(torch.randn_like(p) * (2.0 / p.shape[1] ** 0.5))
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model


# --- GGUF writing as llama.cpp's convert_hf_to_gguf.py does it -------------------------------------


_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama3_rope_factors(spec: dict) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf.py computes it for Llama 3 scaling."""
    import math

    s = spec["scaling"]
    head_dim = HIDDEN // HEADS
    freqs = 1.0 / (spec["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_ctx = s["original_max_position_embeddings"]
    low_freq_wavelen = old_ctx / s["low_freq_factor"]
    high_freq_wavelen = old_ctx / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(s["factor"])
        else:
            low, high = s["low_freq_factor"], s["high_freq_factor"]
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(hf, name: str) -> dict[str, np.ndarray]:
    spec = SPECS[name]
    arch = spec["arch"]
    sd = {k: v.detach().float().numpy().copy() for k, v in hf.state_dict().items()}
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if not spec["tie"]:
        out["output.weight"] = sd["lm_head.weight"]
    if spec["scaling"]:
        out["rope_freqs.weight"] = llama3_rope_factors(spec)
    for i in range(LAYERS):
        for hf_name, gg_name in _LAYER_MAP.items():
            key = f"model.layers.{i}.{hf_name}"
            if key not in sd:
                continue
            w = sd[key]
            if arch == "llama" and hf_name == "self_attn.q_proj.weight":
                w = permute_like_llama_cpp(w, HEADS)
            elif arch == "llama" and hf_name == "self_attn.k_proj.weight":
                w = permute_like_llama_cpp(w, KV_HEADS)
            out[f"blk.{i}.{gg_name}"] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def write_tiny_gguf(path: Path, hf, name: str) -> Path:
    arch = SPECS[name]["arch"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(SPECS[name]["rope_theta"])
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(0)  # ALL_F32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_level_symbols())
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for tensor_name, t in gguf_tensors(hf, name).items():
        w.add_tensor(tensor_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    """(spec name, transformers model, HF folder, GGUF file) for one spec."""
    name = request.param
    hf = build_hf_model(name)
    folder = tmp_path_factory.mktemp(f"hf-{name}")
    hf.save_pretrained(str(folder), safe_serialization=True)
    gguf_path = write_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{name}") / f"tiny-{name}.gguf", hf, name)
    return name, hf, folder, gguf_path


@pytest.fixture(scope="module")
def hf_reference(tiny):
    """transformers' logits and greedy continuations for each prompt."""
    _, hf, _, _ = tiny
    ps = prompts()
    return ps, [hf_last_logits(hf, p) for p in ps], [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


@pytest.fixture(scope="module")
def ours_from_folder(tiny):
    return load_model(str(tiny[2]), device="cpu")


@pytest.fixture(scope="module")
def ours_from_gguf(tiny):
    return load_model(str(tiny[3]), device="cpu")


# --- HF folder --------------------------------------------------------------------------------------

def test_folder_config(tiny, ours_from_folder):
    name, _, folder, _ = tiny
    spec = SPECS[name]
    arch = spec["arch"]
    cfg = ours_from_folder.config
    assert (folder / "config.json").is_file()
    assert not (folder / "tokenizer.json").exists()
    assert ours_from_folder.tokenizer is None
    assert cfg.architecture == arch
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (LAYERS, HIDDEN, INTERMEDIATE)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (HEADS, KV_HEADS, 16, VOCAB)
    assert cfg.tie_word_embeddings == spec["tie"]
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.rms_norm_eps == pytest.approx(RMS_EPS)
    assert cfg.rope_theta == spec["rope_theta"], (
        f"config.json written by transformers {transformers.__version__} has rope_theta inside "
        f"'rope_parameters'; our config has rope_theta={cfg.rope_theta}"
    )
    if spec["scaling"]:
        assert cfg.rope_scaling.rope_type == "llama3", cfg.rope_scaling
        assert cfg.rope_scaling.factor == spec["scaling"]["factor"]


def test_folder_logits_match_transformers(tiny, hf_reference, ours_from_folder):
    ps, ref_logits, _ = hf_reference
    errs = [rel_err(our_last_logits(ours_from_folder, p), ref) for p, ref in zip(ps, ref_logits, strict=True)]
    print(f"{tiny[0]} HF folder: max rel err per prompt {errs}")
    assert max(errs) < LOGITS_RTOL, errs


def test_folder_greedy_matches_transformers(tiny, hf_reference, ours_from_folder):
    ps, _, ref_tokens = hf_reference
    for p, ref in zip(ps, ref_tokens, strict=True):
        assert len(ref) == NEW_TOKENS
        assert our_greedy(ours_from_folder, p, NEW_TOKENS) == ref, f"prompt {p}"


def test_folder_with_legacy_rope_theta_key(tiny, hf_reference, tmp_path):
    """The same folder with config.json as transformers 4 wrote it (top-level ``rope_theta``, the form
    most Hub checkpoints have): isolates the reading of the RoPE base from the rest of the folder path."""
    import json
    import shutil

    name, _, folder, _ = tiny
    spec = SPECS[name]
    legacy = tmp_path / f"legacy-{name}"
    shutil.copytree(folder, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", spec["rope_theta"])
    if spec["scaling"]:
        cfg["rope_scaling"] = {"rope_type": "llama3", **spec["scaling"]}
    (legacy / "config.json").write_text(json.dumps(cfg, indent=2))
    lm = load_model(str(legacy), device="cpu")
    assert lm.config.rope_theta == spec["rope_theta"]
    ps, ref_logits, ref_tokens = hf_reference
    errs = [rel_err(our_last_logits(lm, p), ref) for p, ref in zip(ps, ref_logits, strict=True)]
    print(f"{name} HF folder (legacy rope_theta key): max rel err per prompt {errs}")
    assert max(errs) < LOGITS_RTOL, errs
    assert our_greedy(lm, ps[1], NEW_TOKENS) == ref_tokens[1]


# --- GGUF file ----------------------------------------------------------------------------------------

def test_chunked_prefill_matches_single_prefill(tiny, hf_reference, ours_from_gguf):
    """Feeding the prompt in pieces (positions continuing in the same cache) changes nothing."""
    ps, ref_logits, _ = hf_reference
    p, ref = ps[2], ref_logits[2]
    whole = our_last_logits(ours_from_gguf, p)
    for chunks in ([1] * len(p), [5, 17, len(p) - 22], [len(p) - 1, 1]):
        pieces = our_last_logits(ours_from_gguf, p, chunks)
        assert rel_err(pieces, whole) < 1e-5, chunks
        assert rel_err(pieces, ref) < LOGITS_RTOL, chunks


def test_gguf_config(tiny, ours_from_gguf):
    spec = SPECS[tiny[0]]
    arch = spec["arch"]
    cfg = ours_from_gguf.config
    assert cfg.architecture == arch
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (LAYERS, HIDDEN, INTERMEDIATE)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (HEADS, KV_HEADS, 16, VOCAB)
    assert cfg.rope_theta == spec["rope_theta"]
    assert cfg.rms_norm_eps == pytest.approx(RMS_EPS)
    assert cfg.max_position_embeddings == CONTEXT
    assert cfg.tie_word_embeddings == spec["tie"]
    assert cfg.attention_bias == (arch == "qwen2")
    assert set(ours_from_gguf.weight_types) == {"F32"}


def test_gguf_logits_match_transformers(tiny, hf_reference, ours_from_gguf):
    ps, ref_logits, _ = hf_reference
    errs = [rel_err(our_last_logits(ours_from_gguf, p), ref) for p, ref in zip(ps, ref_logits, strict=True)]
    print(f"{tiny[0]} GGUF: max rel err per prompt {errs}")
    assert max(errs) < LOGITS_RTOL, errs


def test_gguf_greedy_matches_transformers(tiny, hf_reference, ours_from_gguf):
    ps, _, ref_tokens = hf_reference
    for p, ref in zip(ps, ref_tokens, strict=True):
        assert our_greedy(ours_from_gguf, p, NEW_TOKENS) == ref, f"prompt {p}"


def test_gguf_weights_equal_folder_weights(tiny, ours_from_folder, ours_from_gguf):
    """After un-permuting, Q and K from the GGUF are exactly the HF projections."""
    a, b = ours_from_folder.model, ours_from_gguf.model
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.qkv.weight, lb.qkv.weight)
        assert (la.qkv.bias is None) == (lb.qkv.bias is None)
        if la.qkv.bias is not None:
            assert torch.equal(torch.as_tensor(la.qkv.bias), torch.as_tensor(lb.qkv.bias))
        assert torch.equal(la.gate_up.weight, lb.gate_up.weight)
        assert torch.equal(la.o.weight, lb.o.weight) and torch.equal(la.down.weight, lb.down.weight)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_gguf_byte_level_tokenizer(tiny, ours_from_gguf):
    """The minimal gpt2 tokenizer (256 byte symbols, no merges): one token per UTF-8 byte."""
    tok = ours_from_gguf.tokenizer
    assert tok is not None
    assert tok.bos_token_id == 1 and tok.eos_token_ids[:1] == [2]
    for text in ["hi", "Hello, world!", " spaced  out\n", "naïve café 日本 😀"]:
        ids = tok.encode(text, add_special=False)
        assert ids == list(text.encode("utf-8")), text
        assert tok.decode(ids) == text


def test_transformers_loads_our_tiny_gguf_the_same(tiny, hf_reference):
    """Cross-check: transformers' own GGUF loader reads the file we wrote to the same model. For the
    Llama-3-scaled spec it must not: its loader ignores rope_freqs.weight, which we apply."""
    arch, _, _, gguf_path = tiny
    other = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    ps, ref_logits, _ = hf_reference
    errs = [rel_err(hf_last_logits(other, p), ref) for p, ref in zip(ps, ref_logits, strict=True)]
    if SPECS[arch]["scaling"]:
        assert max(errs) > 100 * LOGITS_RTOL, errs
    else:
        assert max(errs) < LOGITS_RTOL, errs


def test_auto_weights_are_q4_for_a_gguf_on_the_cpu_and_f32_for_a_folder(tiny):
    """f32's logits within KLD 1e-6 by default (models.linear.CPU_GGUF_FORMAT); an HF folder's weights
    stay as the folder holds them."""
    assert load_model(str(tiny[3]), device="cpu", weight_format="auto").model.weight_format == "q4"
    assert load_model(str(tiny[2]), device="cpu", weight_format="auto").model.weight_format == "f32"

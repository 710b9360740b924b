"""Tiny random models of every architecture beyond llama/qwen2/gemma3, built with transformers and
written both as an HF folder (``save_pretrained``) and as a GGUF file laid out as llama.cpp's converter
lays it out (its tensor names and metadata keys per architecture, q/k rows permuted where it permutes
them, Gemma norms stored as 1 + w, experts stacked into [experts, out, in] tensors)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

Q4_1 = gguf.GGMLQuantizationType.Q4_1
VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 256, 128, 256, 4, 2, 32, 512
EXPERTS, TOP_K, MOE_INTER = 8, 2, 32
EPS = 1e-6

# name -> (transformers class names, config kwargs beyond the common ones, GGUF arch, layers)
SPECS: dict[str, dict] = {
    "qwen3": {"cls": "Qwen3", "arch": "qwen3", "kw": {"rope_theta": 1e6}},
    "qwen3-yarn": {"cls": "Qwen3", "arch": "qwen3", "kw": {"rope_theta": 1e6}, "rope": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "mistral": {"cls": "Mistral", "arch": "llama", "kw": {"rope_theta": 1e6, "sliding_window": 8}},
    "phi3": {"cls": "Phi3", "arch": "phi3",
             "kw": {"rope_theta": 1e4, "pad_token_id": 0, "sliding_window": None},
                 "partial": 0.5},
    "phi3-longrope": {"cls": "Phi3", "arch": "phi3",
                      "kw": {"rope_theta": 1e4, "pad_token_id": 0, "sliding_window": None,
                                                           "original_max_position_embeddings": 128},
                          "partial": 0.5, "rope": "longrope"},
    "gemma2": {"cls": "Gemma2", "arch": "gemma2", "layers": 4, "kw": {
        "rope_theta": 1e4, "sliding_window": 8, "query_pre_attn_scalar": HEAD_DIM,
        "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0, "head_dim": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh"}},
    "granite": {"cls": "Granite", "arch": "granite", "kw": {
        "rope_theta": 1e4, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
        "attention_multiplier": 0.2, "logits_scaling": 4.0}},
    "qwen3moe": {"cls": "Qwen3Moe", "arch": "qwen3moe", "kw": {
        "rope_theta": 1e6, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_INTER, "norm_topk_prob": True}},
    "olmoe": {"cls": "Olmoe", "arch": "olmoe", "kw": {
        "rope_theta": 1e4, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "intermediate_size": MOE_INTER, "norm_topk_prob": False}},
}


def layers_of(name: str) -> int:
    return SPECS[name].get("layers", 2)


def build_hf_model(name: str, vocab: int = VOCAB):
    spec = SPECS[name]
    Config = getattr(transformers, spec["cls"] + "Config")
    Model = getattr(transformers, spec["cls"] + "ForCausalLM")
    kw = dict(spec["kw"])
    theta = kw.pop("rope_theta")
    rope: dict = {"rope_theta": theta, "rope_type": "default"}
    if isinstance(spec.get("rope"), dict):
        rope = {"rope_theta": theta, **spec["rope"]}
    g = torch.Generator().manual_seed(7)
    if spec.get("partial"):
        rope["partial_rotary_factor"] = spec["partial"]
    if spec.get("rope") == "longrope":
        half = int(HEAD_DIM * spec["partial"]) // 2
        rope.update(rope_type="longrope", short_factor=(1 + 2 * torch.rand(half, generator=g)).tolist(),
                    long_factor=(1 + 8 * torch.rand(half, generator=g)).tolist())
    common = {"vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": layers_of(name),
                  "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                  "max_position_embeddings": CONTEXT, "rms_norm_eps": EPS,
                  "tie_word_embeddings": spec["arch"] == "gemma2", "bos_token_id": None, "eos_token_id": None}
    common.update(kw)
    if "head_dim" not in common and spec["cls"] in ("Qwen3", "Qwen3Moe"):
        common["head_dim"] = HEAD_DIM
    config = Config(**common, rope_parameters=rope)
    torch.manual_seed(0)
    model = Model(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_((0.0 if spec["arch"] == "gemma2" else 1.0) + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in pname or "lm_head" in pname:
                p.copy_(torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):  # router: spread, so the top-k is no near-tie
                p.copy_(torch.randn_like(p) * 2.0)
            else:
                p.copy_(torch.randn_like(p) * (2.0 / p.shape[-1] ** 0.5))
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _tensors(hf, name: str) -> dict[str, np.ndarray]:
    spec = SPECS[name]
    arch = spec["arch"]
    sd = {k: v.detach().float().numpy().copy() for k, v in hf.state_dict().items()}
    gemma = arch == "gemma2"

    def norm(key: str) -> np.ndarray:
        return sd[key] + 1.0 if gemma else sd[key]

    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": norm("model.norm.weight")}
    if "lm_head.weight" in sd and not hf.config.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    if spec.get("rope") == "longrope":
        rp = hf.config.rope_parameters
        out["rope_factors_short.weight"] = np.array(rp["short_factor"], dtype=np.float32)
        out["rope_factors_long.weight"] = np.array(rp["long_factor"], dtype=np.float32)
    permute = arch in ("llama", "granite")
    for i in range(layers_of(name)):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = norm(p + "input_layernorm.weight")
        out |= _qkv_tensors(sd, arch, p, b, permute)
        out[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        if p + "self_attn.q_norm.weight" in sd:
            out[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out |= _ffn_norm_tensors(sd, p, b, norm, gemma)
        out |= _ffn_tensors(sd, arch, p, b)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def _qkv_tensors(sd: dict[str, np.ndarray], arch: str, p: str, b: str,
                 permute: bool) -> dict[str, np.ndarray]:
    """Layer ``p``'s q/k/v as GGUF layer ``b``'s: phi3's fused (with its fused gate/up, where the converter
    writes it), else q, k (rows permuted as llama.cpp permutes them, where ``permute``) and v."""
    if arch == "phi3":
        return {b + "attn_qkv.weight": sd[p + "self_attn.qkv_proj.weight"],
                b + "ffn_up.weight": sd[p + "mlp.gate_up_proj.weight"]}
    q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
    if permute:
        q, k = permute_like_llama_cpp(q, HEADS), permute_like_llama_cpp(k, KV_HEADS)
    return {b + "attn_q.weight": q, b + "attn_k.weight": k,
            b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"]}


def _ffn_norm_tensors(sd: dict[str, np.ndarray], p: str, b: str, norm, gemma: bool) -> dict[str, np.ndarray]:
    """Layer ``p``'s norms around the feed-forward as GGUF layer ``b``'s: Gemma 2's three (through ``norm``:
    1 + w), else the one before the feed-forward."""
    if gemma:
        return {b + "post_attention_norm.weight": norm(p + "post_attention_layernorm.weight"),
                b + "ffn_norm.weight": norm(p + "pre_feedforward_layernorm.weight"),
                b + "post_ffw_norm.weight": norm(p + "post_feedforward_layernorm.weight")}
    return {b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"]}


def _ffn_tensors(sd: dict[str, np.ndarray], arch: str, p: str, b: str) -> dict[str, np.ndarray]:
    """Layer ``p``'s feed-forward as GGUF layer ``b``'s: a router and experts stacked per projection, else
    gate, up and down (phi3: down alone, its gate/up went with q/k/v)."""
    out = {}
    if p + "mlp.gate.weight" in sd:
        out[b + "ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
        # transformers holds the experts fused in memory ([experts, 2 * inter, hidden], gate then up)
        gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)
        out |= {b + "ffn_gate_exps.weight": gate, b + "ffn_up_exps.weight": up,
                b + "ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"]}
    elif arch != "phi3":
        out |= {b + "ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
                b + "ffn_up.weight": sd[p + "mlp.up_proj.weight"],
                b + "ffn_down.weight": sd[p + "mlp.down_proj.weight"]}
    if arch == "phi3":
        out[b + "ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def write_gguf(path: Path, hf, name: str, quantized: bool = False,
               extra_tokens: tuple[tuple[str, int], ...] = (), chat_template: str | None = None,
               eos_token_id: int = 2, pooling: gguf.PoolingType | None = None) -> Path:
    """quantized: every projection (experts included) stored as Q4_1, as a 4-bit file stores them.
    extra_tokens: (text, GGUF token type) after the 256 byte symbols (the HF model's vocab must count them).
    pooling: an embedding model's pooling type (and its tokenizer adds the end-of-text token), as
    llama.cpp's converter writes Qwen3-Embedding."""
    spec = SPECS[name]
    arch, cfg = spec["arch"], hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(layers_of(name))
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(HEAD_DIM * spec.get("partial", 1.0)))
    w.add_layer_norm_rms_eps(EPS)
    w.add_file_type(0)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    _add_rope_scaling(w, cfg, spec.get("rope"))
    _add_arch_keys(w, arch, cfg)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_level_symbols() + [text for text, _ in extra_tokens])
    w.add_token_types([1] * VOCAB + [kind for _, kind in extra_tokens])
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if pooling is not None:
        w.add_pooling_type(pooling)
        w.add_add_eos_token(True)
    for tensor_name, t in _tensors(hf, name).items():
        projection = t.ndim >= 2 and tensor_name.startswith("blk.") and "ffn_gate_inp" not in tensor_name
        if quantized and projection:
            w.add_tensor(tensor_name, gguf.quants.quantize(t, Q4_1), raw_dtype=Q4_1)
        else:
            w.add_tensor(tensor_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_rope_scaling(w: gguf.GGUFWriter, cfg, rope) -> None:
    """The keys of the spec's ``rope`` scaling, as llama.cpp's converter writes them (YaRN's, or
    LongRoPE's)."""
    if isinstance(rope, dict) and rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope == "longrope":  # as convert_hf_to_gguf.py's Phi3MiniModel: the factors as tensors, this key
        scale = CONTEXT / cfg.rope_parameters["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            float(
                np.sqrt(1 + np.log(scale) / np.log(cfg.rope_parameters["original_max_position_embeddings"]))))
        w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])


def _add_arch_keys(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    """The keys only some architectures have: Gemma 2's soft caps, Granite's multipliers, the experts'."""
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch in ("qwen3moe", "olmoe"):
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(TOP_K)
        w.add_expert_feed_forward_length(MOE_INTER)


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode table: symbol i stands for byte i."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, (chr(c) for c in cs), strict=True))
    return [table[b] for b in range(256)]

"""Which kernels each architecture runs on, and that a feature a kernel lacks falls back to torch
rather than giving wrong results; mixture-of-experts decode reads only the chosen experts.

The files here store every projection (experts included) as Q4_1, as a 4-bit GGUF does, so
``--weights q4`` holds them in the native 4-bit format."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import native_paged
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.linear import Int4Linear
from kvserve.models.loader import load_model
from tests.models import arch_builders as ab
from tests.models.hf_reference import hf_greedy, rel_err
from tests.support import assert_same_or_near_tie, make_engine, reference_greedy


@pytest.fixture(scope="module")
def q4_files(tmp_path_factory):
    """name -> a Q4_1 GGUF of that tiny architecture (built once, on demand)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            hf = ab.build_hf_model(name)
            cache[name] = ab.write_gguf(tmp_path_factory.mktemp(name) / f"{name}-q4_1.gguf", hf, name,
                                        quantized=True)
        return cache[name]

    return get


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(0, ab.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["qwen3moe", "olmoe"])
def test_moe_decode_runs_only_the_chosen_experts(q4_files, name):
    """A decode step of one sequence runs exactly top-k experts a layer, reading only their 4-bit weights;
    the router stays f32; the 4-bit model's logits are the f32 model's within the kernel's rounding."""
    lm = load_model(str(q4_files(name)), device="cpu", weight_format="q4")
    f32 = load_model(str(q4_files(name)), device="cpu", weight_format="f32")
    moes = [layer.moe for layer in lm.model.layers]
    assert all(isinstance(lin, Int4Linear) for m in moes for lin in m.gate_up + m.down)
    assert all(m.router.dtype == torch.float32 and m.num_experts == ab.EXPERTS for m in moes)

    prompt = _prompt(20)
    cache = ContiguousKVCache(lm.config.num_layers)
    hidden = lm.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
    token = int(lm.model.compute_logits(hidden[-1:]).argmax())
    for m in moes:
        m.expert_calls, m.bytes_read = [0] * m.num_experts, 0
    h_in = []  # each layer's MoE input, to check which experts the router chose
    for m in moes:
        route = m.route
        m.route = lambda h, route=route: h_in.append(h.clone()) or route(h)
    lm.model.forward(torch.tensor([token]), torch.tensor([len(prompt)]), cache)
    for m, h in zip(moes, list(h_in), strict=True):  # a copy: route() below appends to h_in
        chosen = set(m.route(h)[1][0].tolist())
        assert [i for i, c in enumerate(m.expert_calls) if c] == sorted(chosen)
        assert sum(m.expert_calls) == ab.TOP_K
        expert_bytes = m.gate_up[0].nbytes + m.down[0].nbytes
        assert m.bytes_read == ab.TOP_K * expert_bytes  # of EXPERTS * expert_bytes held
    del m.route

    # the same input routes alike (the f32 router), and the 4-bit experts give the f32 ones' output
    # within the kernel's activation rounding (a whole forward is no test of that: a near-tie in some
    # token's routing, flipped by any rounding, changes that token's MLP outright)
    h = torch.randn(16, ab.HIDDEN, generator=torch.Generator().manual_seed(0))
    for m4, m32 in zip(moes, (layer.moe for layer in f32.model.layers), strict=True):
        assert torch.equal(m4.route(h)[1], m32.route(h)[1])
        assert rel_err(m4(h), m32(h)) < 1e-4


@pytest.mark.parametrize("name", ["qwen3moe", "olmoe"])
def test_moe_paged_engine_decode_step_counts(q4_files, name):
    """Through the paged engine: a step that decodes two sequences runs at most 2 * top-k experts a layer."""
    lm = load_model(str(q4_files(name)), device="cpu", weight_format="q4")
    engine = make_engine(lm, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for seed in (1, 2):
        engine.add_request(_prompt(12, seed), params)
    engine.step()  # both prompts
    moes = [layer.moe for layer in lm.model.layers]
    for m in moes:
        m.expert_calls = [0] * m.num_experts
    engine.step()  # one decode token each
    assert all(ab.TOP_K <= sum(m.expert_calls) <= 2 * ab.TOP_K for m in moes)
    assert all(max(m.expert_calls) == 1 for m in moes)  # each chosen expert runs once over its tokens


class _Spy:
    """Counts the native paged attention kernels' calls."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for method in ("decode", "prefill"):
            original = getattr(native_paged.NativePagedAttention, method)

            def counted(this, *args, original=original, **kwargs):
                self.calls += 1
                return original(this, *args, **kwargs)

            monkeypatch.setattr(native_paged.NativePagedAttention, method, counted)


@pytest.mark.parametrize("name", ["gemma2", "qwen3"])
def test_softcapped_attention_runs_on_the_native_kernels(q4_files, monkeypatch, name):
    """The native attention kernels cap scores themselves: gemma2 calls them, as a model without a cap
    does (from Python, or inside the one-call step), and gives the reference's (torch, contiguous) tokens
    over a window-crossing prompt."""
    lm = load_model(str(q4_files(name)), device="cpu", weight_format="q4")
    spy = _Spy(monkeypatch)
    engine = make_engine(lm, budget=16)
    prompt = _prompt(30)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    if native_paged.for_storage(engine.storage) is not None:
        step = engine.runner.native_step
        assert spy.calls + (step.calls if step is not None else 0) > 0
    assert_same_or_near_tie(lm, prompt, reference_greedy(lm, prompt, 10), out.token_ids)


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory):
    """transformers' tiny Gemma 2 and ours from its folder (f32 weights: torch matmuls, native attention)."""
    hf = ab.build_hf_model("gemma2")
    folder = tmp_path_factory.mktemp("hf-gemma2")
    hf.save_pretrained(str(folder))
    return hf, load_model(str(folder), device="cpu")


@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_gemma2_through_the_native_kernels_batched_and_chunked(gemma2_folder, monkeypatch, cache_type):
    """Three prompts past the window of 8, chunked (a budget of 16 tokens a step) and batched, through the
    capped native kernels: each gets the tokens it gets alone with whole prefills (the same KV type),
    and with f32 KV transformers' greedy tokens."""
    hf, lm = gemma2_folder
    ps = [_prompt(n, seed) for n, seed in ((40, 4), (23, 5), (9, 6))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spy = _Spy(monkeypatch)
    alone = []
    for p in ps:
        engine = make_engine(lm, max_num_seqs=1, prefix_caching=False, block_size=8, cache_type_k=cache_type)
        rid = engine.add_request(p, params).request_id
        alone.append(engine.run_to_completion()[rid].token_ids)
    engine = make_engine(lm, budget=16, max_num_seqs=3, block_size=8, cache_type_k=cache_type)
    ids = [engine.add_request(p, params).request_id for p in ps]
    final = engine.run_to_completion()
    if native_paged.for_storage(engine.storage) is None:
        pytest.skip("no native attention kernels on this machine")
    assert spy.calls > 0
    for p, own, batched in zip(ps, alone, (final[i].token_ids for i in ids), strict=True):
        assert batched == own, p
        if cache_type == "f32":
            assert_same_or_near_tie(lm, p, hf_greedy(hf, p, 16), own)


def test_gemma2_capped_in_torch_without_native_attention(gemma2_folder, monkeypatch):
    """Without native attention kernels (another device) the engine runs Gemma 2 through the paged
    backend's torch path, chunked and batched, to transformers' greedy tokens. (This tiny random model's
    answer hardly depends on the cap: the capped arithmetic itself is checked in
    tests/attention/test_capped.py.)"""
    hf, lm = gemma2_folder
    monkeypatch.setattr(native_paged, "for_storage", lambda storage: None)
    spy = _Spy(monkeypatch)
    ps = [_prompt(n, seed) for n, seed in ((40, 4), (23, 5))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = make_engine(lm, budget=16, max_num_seqs=2, block_size=8)
    assert engine.runner.native_step is None
    ids = [engine.add_request(p, params).request_id for p in ps]
    final = engine.run_to_completion()
    assert spy.calls == 0  # no native attention ran: the torch path did
    for p, rid in zip(ps, ids, strict=True):
        assert_same_or_near_tie(lm, p, hf_greedy(hf, p, 12), final[rid].token_ids)


@pytest.mark.parametrize("name,one_call",
                         [("mistral", True), ("qwen3", True), ("gemma2", True), ("phi3", False),
                                           ("granite", False), ("qwen3moe", False)])
def test_one_call_step_only_where_its_kernels_cover_the_arch(q4_files, name, one_call):
    """The one-call native step (models/native_step.py) runs Mistral (a plain Llama with a
    window), Qwen3 (q/k norms per head) and Gemma 2 (capped scores, post-norms, GELU); partial rotary,
    Granite's multipliers and experts go through ``forward``. Either way the engine's tokens are the reference
    path's."""
    lm = load_model(str(q4_files(name)), device="cpu", weight_format="q4")
    engine = make_engine(lm, budget=16)
    step = engine.runner.native_step
    prompt = _prompt(30)  # longer than mistral's window of 8
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).request_id
    out = engine.run_to_completion()[rid]
    if one_call and native_paged.for_storage(engine.storage) is not None:
        assert step is not None and step.calls > step.prefill_calls > 0
    if not one_call:
        assert step is None
    assert_same_or_near_tie(lm, prompt, reference_greedy(lm, prompt, 10), out.token_ids)

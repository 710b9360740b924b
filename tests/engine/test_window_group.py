"""Gemma 3's sliding-window layers keep only their window (``kv.window_blocks``): the same steps give the
same logits, bit for bit, as an engine whose every layer keeps every token, while the window pool holds
a window's worth of blocks per request. Prompts past the window of 512, chunked prefill, a prefix hit,
a request joining late, preemption, the one-call decode step and the torch attention path (fp8 KV)."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.cache_types import kv_bytes_per_token_per_layer
from kvserve.kv.groups import window_pool_blocks
from kvserve.models.loader import load_model
from tests.support import make_engine, recorded_steps

WINDOW = 512


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3-270m", weight_format="q4")


@pytest.fixture(scope="module")
def prompts(gemma3):
    text = ("The river town kept its records in a stone house by the bridge, and every spring the "
            "clerks copied the old ledgers before the floods came. ") * 40
    ids = gemma3.tokenizer.encode(text)
    assert len(ids) > 2 * WINDOW + 100
    # past the window; a prefix of the first (a prefix hit once the first has run); short
    return [ids[: 2 * WINDOW + 90], ids[: 2 * WINDOW + 90] + ids[5:40], ids[:200]]


def recorded_run(engine, prompts: list[list[int]],
                 max_tokens: int = 12) -> list[tuple[list[str], torch.Tensor]]:
    """Every step's (ready request ids, logits): the first prompt alone for a few steps (so the second
    can hit its prefix), then the rest."""
    steps = recorded_steps(engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(prompts[0], params, request_id="r0")
    r0 = engine.scheduler.requests["r0"]
    while r0.num_tokens - r0.num_prompt_tokens < 2:
        engine.step()
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(p, params, request_id=f"r{i}")
    engine.run_to_completion()
    return steps


def assert_same_steps(a, b) -> None:
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    for (ids, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), f"logits differ in a step of {ids}"


@pytest.mark.parametrize("cache_types, budget", [(("f32", "f32"), 512), (("f32", "f32"), 96),
                                                 (("q8_0", "q4_0"), 512)])
def test_same_logits_as_every_token_kept(gemma3, prompts, cache_types, budget, check_no_leaks):
    k, v = cache_types
    windowed = make_engine(gemma3, num_ctx=2048, max_num_seqs=4, budget=budget, cache_type_k=k,
                           cache_type_v=v)
    full = make_engine(gemma3, num_ctx=2048, max_num_seqs=4, budget=budget, cache_type_k=k, cache_type_v=v,
                       window_kv=False)
    check_no_leaks.extend([windowed, full])
    assert windowed.storage.windowed and not full.storage.windowed
    assert windowed.storage.nbytes < full.storage.nbytes / 2
    a, b = recorded_run(windowed, prompts), recorded_run(full, prompts)
    assert_same_steps(a, b)
    assert windowed.runner.native_step.calls > 0  # the one-call step ran on the window tables
    assert windowed.scheduler.requests == {} and windowed.kv.tied[0].num_held_blocks() == 0
    # the second request reused the first one's prefix in both engines
    assert windowed.kv.prefix_hits == full.kv.prefix_hits > WINDOW


def test_window_pool_holds_a_window_per_request(gemma3, prompts, check_no_leaks):
    engine = make_engine(gemma3, num_ctx=2048, max_num_seqs=2)
    check_no_leaks.append(engine)
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       request_id="r0")
    for _ in range(5):
        engine.step()
    request = engine.scheduler.requests["r0"]
    window_table = engine.kv.tied[0].block_ids("r0")
    held = [b for b in window_table if b != 0]
    assert len(window_table) == len(engine.kv.block_ids("r0")) == -(-request.num_computed_tokens // 16)
    # blocks from the one holding position computed - window + 1 on, no more
    assert len(held) == len(window_table) - (request.num_computed_tokens - WINDOW + 1) // 16
    assert len(held) <= WINDOW // 16 + 2
    engine.run_to_completion()


def test_preemption_and_fp8_through_the_torch_path(gemma3, prompts, check_no_leaks):
    """fp8 KV has no C writer: writes and attention go through torch, reading the window tables; a
    pool for about one long request forces preemption."""
    kw = {"num_ctx": 2048, "max_num_seqs": 3, "budget": 256, "cache_type_k": "fp8"}
    layer_block = 16 * kv_bytes_per_token_per_layer(gemma3.config, "fp8")
    window_bytes = window_pool_blocks(WINDOW, 16, 3, 256) * 15 * layer_block  # 15 sliding layers, 3 global
    full_blocks = 125  # one long request at a time (and more context than every layer every token)
    windowed = make_engine(gemma3, kv_cache_memory=window_bytes + full_blocks * 3 * layer_block, **kw)
    full = make_engine(gemma3, window_kv=False, **kw)
    check_no_leaks.extend([windowed, full])
    assert windowed.runner.native_step is None
    assert windowed.kv.num_blocks == full_blocks and windowed.storage.window_layers
    out = []
    unshared = [prompts[0], prompts[0][3:] + prompts[2][:3], prompts[2]]  # two long prompts, no common prefix
    for engine in (windowed, full):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for i, p in enumerate(unshared):
            engine.add_request(p, params, request_id=f"r{i}")
        out.append({rid: o.token_ids for rid, o in engine.run_to_completion().items()})
    assert out[0] == out[1]
    assert windowed.num_preemptions > 0


def test_the_pool_frame_shows_the_window_pool(gemma3, prompts, check_no_leaks):
    """The web page's frame: the window pool's codes beside the pool's, each request's window table, and
    bytes counted per group (a request past the window holds far less than every layer every token)."""
    import threading
    from types import SimpleNamespace

    from kvserve.server.web.pool_view import PoolView

    engine = make_engine(gemma3, num_ctx=2048, max_num_seqs=2)
    check_no_leaks.append(engine)
    view = PoolView(SimpleNamespace(engine=engine, lock=threading.Lock(), num_pending_adds=0,
                                    dead_error=None),
                    "gemma3")
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       request_id="r0")
    for _ in range(4):
        engine.step()
    frame = view.frame()
    storage, window = engine.storage, engine.kv.tied[0]
    assert len(frame.window_blocks) == window.pool.num_blocks - 1 and frame.window_size == WINDOW
    (request,) = frame.requests
    assert request.window_blocks == engine.kv.tied[0].block_ids("r0") and request.window_blocks[0] == 0
    held = sum(1 for b in request.window_blocks if b)
    assert frame.window_blocks.count("1") == held
    assert request.kv_bytes == (len(request.blocks) * storage.kv_group_bytes_per_block(0)
                                + held * storage.kv_group_bytes_per_block(1))
    # 1,114 tokens, window 512
    assert request.kv_bytes < 0.6 * len(request.blocks) * 16 * frame.kv_bytes_per_token
    assert frame.kv_pool_bytes == storage.nbytes
    engine.run_to_completion()

"""The one-call step (``models/native_step.py``) gives the same logits, bit for bit, as
``DecoderLM.forward`` on the same steps: it makes the same kernel calls without the Python between
them. Checked on SmolLM2 in the q4 formats, with plain, block-quantized and rotated KV, while the
batch grows and shrinks, prompts arrive beside decodes and are read in chunks; and on Gemma 3."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvserve.engine.sampling_params import SamplingParams
from kvserve.models import native_step
from kvserve.models.loader import load_model
from tests.support import make_engine, recorded_steps


@pytest.fixture(scope="module")
def smollm2_q4_fast():
    return load_model("smollm2", weight_format="q4-fast")


def run(engine, prompts: list[list[int]], late: list[int]) -> list:
    """Three requests of different lengths (the batch shrinks as they finish), and a fourth that
    joins after a few steps (the batch grows past the step's first buffers)."""
    steps = recorded_steps(engine)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True),
                           request_id=f"r{i}")
    for _ in range(4):
        engine.step()
    engine.add_request(late, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id="late")
    engine.run_to_completion()
    return steps


def assert_same_logits_as_forward(loaded, cache_types, prompts, late, check_no_leaks, budget=None) -> None:
    """The same steps through the one-call path and through ``forward``: the same requests each step,
    the same logits bit for bit. ``budget``: tokens a step (prompts read in chunks beside decodes)."""
    k, v = cache_types
    options = {"max_num_seqs": 4, "cache_type_k": k, "cache_type_v": v}
    options |= {"budget": budget} if budget else {}
    native = make_engine(loaded, **options)
    plain = make_engine(loaded, **options)
    check_no_leaks.extend([native, plain])
    step = native.runner.native_step
    assert step is not None
    plain.runner.native_step = None
    got, expected = run(native, prompts, late), run(plain, prompts, late)
    assert step.calls >= 10  # the one-call path ran, at 1 to 4 sequences
    assert step.capacity >= 4
    assert step.prefill_calls > 0  # prefill chunks too, rotated codecs' (the kernels rotate the query)
    assert len(got) == len(expected)
    for (ids, logits), (ids_ref, logits_ref) in zip(got, expected, strict=True):
        assert ids == ids_ref
        assert torch.equal(logits, logits_ref)


@pytest.mark.parametrize("cache_types", [("f32", "f32"), ("q8_0", "q4_0"), ("tq4", "tq3")])
@pytest.mark.parametrize("weights", ["q4", "q4-fast"])
def test_same_logits_as_forward(request, weights, cache_types, check_no_leaks):
    loaded = request.getfixturevalue("smollm2_q4") if weights == "q4" else request.getfixturevalue(
        "smollm2_q4_fast")
    prompts = [[1, 504, 3458, 282, 4649, 314] * (1 + i) for i in range(3)]
    assert_same_logits_as_forward(loaded, cache_types, prompts, [1, 9690, 28, 1064, 281], check_no_leaks)


@pytest.mark.parametrize("cache_types", [("f32", "f32"), ("q8_0", "q4_0")])
def test_chunks_beside_decodes_same_logits_as_forward(smollm2_q4, cache_types, check_no_leaks):
    """A budget of 20 tokens a step: each prompt is read in chunks, most of them in the same step as
    other requests' decodes (the batch's rows then interleave chunks and decodes)."""
    prompts = [[1, 504, 3458, 282, 4649, 314, 28] * (3 + 2 * i) for i in range(3)]
    assert_same_logits_as_forward(smollm2_q4, cache_types, prompts, [1, 9690, 28, 1064, 281] * 7,
                                  check_no_leaks, budget=20)


def test_not_used_where_its_kernels_do_not_apply(smollm2, smollm2_q4):
    f32_weights = make_engine(smollm2)
    fp8_kv = make_engine(smollm2_q4, cache_type_k="fp8")  # the C KV writer does not take fp8
    assert f32_weights.runner.native_step is None
    assert fp8_kv.runner.native_step is None
    assert not native_step.supports(smollm2.model)
    assert native_step.supports(smollm2_q4.model)


@pytest.fixture(scope="module")
def gemma3_q4():
    return load_model("gemma3-270m", weight_format="q4")


@pytest.mark.parametrize("cache_types", [("f32", "f32"), ("q8_0", "q4_0")])
def test_gemma3_same_logits_as_forward(gemma3_q4, cache_types, check_no_leaks):
    """Gemma 3: q/k norms, post-norms, GELU gating, an embedding scale, int8 and 4-bit projections, and
    sliding layers with their own RoPE table and window (a prompt longer than the window of 512)."""
    prompts = [[2, 818, 5279, 529, 7001, 563] * n for n in (3, 7, 90)]
    assert_same_logits_as_forward(gemma3_q4, cache_types, prompts, [2, 9259, 236764, 1217, 107],
                                  check_no_leaks, budget=256)


def test_buffers_double_for_decodes_and_fit_prefill_chunks():
    """A batch growing a row at a time replans at 1, 2, 4, ... (doubling up to 256 rows); a step past that
    gets exactly its rows (the planner's ``native_step_bytes`` counts no more)."""
    capacity, planned = 0, []
    for n in [1, 2, 3, 4, 5, 9, 100, 101, 300, 512, 40, 700]:
        if (new := native_step.rows_to_plan(n, capacity)) != capacity:
            planned.append(new)
            capacity = new
    assert planned == [1, 2, 4, 8, 16, 100, 200, 300, 512, 700]


class _TorchCalls(TorchFunctionMode):
    """Records every torch function and tensor method called while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__qualname__", getattr(func, "__name__", repr(func))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loaded", ["smollm2_q4", "gemma3_q4"])
def test_a_step_calls_no_torch(request, loaded, check_no_leaks):
    """Once its buffers are planned and the RoPE tables cover the positions, a step on the one-call path
    (a prompt chunk, then decodes, then a chunk beside decodes) calls no torch function or tensor method:
    the inputs, the embedding rows, the RoPE rows, the logits and the sampled tokens are numpy and C."""
    engine = make_engine(request.getfixturevalue(loaded), max_num_seqs=2)
    check_no_leaks.append(engine)
    assert engine.runner.native_step is not None
    prompt = [2, 504, 3458, 282, 4649, 314, 28, 1064, 281, 13]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(prompt + prompt, greedy, request_id="warm")  # plans 20 rows, grows the tables
    engine.run_to_completion()
    with _TorchCalls() as torch_calls:
        engine.add_request(prompt, greedy, request_id="a")
        for _ in range(3):
            engine.step()
        engine.add_request(prompt[:7], greedy, request_id="b")  # its chunk beside a's decode
        engine.run_to_completion()
    assert engine.runner.native_step.calls >= 8
    assert torch_calls.calls == []

"""Ways of running the same prompts, compared with each other bit for bit (f32 KV, greedy).

SmolLM2 as it is served: q4 weights (the 4-bit and int8-group kernels, which compute a row the same
way whatever else is in the batch), native paged attention and the one-call decode step. Each prompt
run alone (whole prefill, no prefix cache) is the baseline; run batched with the others, with its
prompt in chunks of 16 tokens mixed with other requests' decode steps, with its prefix found in the
cache, through ``DecoderLM.forward`` instead of the one-call step, or on another number of threads,
it gives the same token ids, the same logprobs and the same logits rows, compared with ``==``.

Not yet bit for bit: a token that a decode step computed and a prefill computes again (a preempted
request's recomputation; a second chat turn repeating the first answer, without the prefix cache).
The decode and the prefill attention kernels sum a row in different orders (~1e-7 apart), and the
q4 activations' int8 digits carry that to ~0.01 in the logits. The same holds for a prompt chunk of
a single token, which the runner attends with the decode kernel. Those tests assert the tokens and a
logits bound, and state bit-identity as an expected failure (strict: it fails once it holds).

The tiny random model runs f32 weights through torch's matmul, which does not promise a row the same
last bits in a batch as alone (~1e-6 here): its token ids are compared, with each other's and with
the contiguous reference path's (a difference from the reference must be a checked near-tie)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from kvserve.attention import native_paged
from kvserve.engine.outputs import TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.linear import Int4Linear
from tests.support import assert_same_or_near_tie, make_engine, prompts_for, reference_greedy

NUM_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=5)
# Largest logits difference a recomputed token may make (measured on SmolLM2 q4 with f32 KV, AVX2
# path: 0.013 after preemption, 0.012 on a second turn, 0.014-0.019 for one to ten recomputed tokens).
RECOMPUTED_LOGITS_ATOL = 0.1


@dataclass
class Output:
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    logits: torch.Tensor  # [generated tokens, vocab]: the rows the sampler was given
    num_cached_tokens: int


@dataclass
class Recorder:
    """Wraps an engine's runner: keeps every request's logits rows, and what the steps were like."""

    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    max_ready: int = 0  # most requests given logits in one step
    partial_prefills: int = 0  # prompt chunks that were not a prompt's last
    mixed_steps: int = 0  # steps with decode tokens and prompt chunks together
    one_token_prompt_chunks: int = 0  # attended with the prompts, not by the decode kernel

    def attach(self, engine) -> Recorder:
        execute = engine.runner.execute

        def recording(out):
            sizes = [s.num_new_tokens for s in out.scheduled]
            self.partial_prefills += sum(
                s.request.num_computed_tokens + s.num_new_tokens < s.request.num_tokens for s in out.scheduled
            )
            self.mixed_steps += 1 in sizes and any(n > 1 for n in sizes)
            self.one_token_prompt_chunks += sum(
                s.num_new_tokens == 1 and s.request.num_computed_tokens < s.request.num_prompt_tokens
                for s in out.scheduled)
            ready, logits = execute(out)
            self.max_ready = max(self.max_ready, len(ready))
            for request, row in zip(ready, logits, strict=True):
                self.rows.setdefault(request.request_id, []).append(torch.from_numpy(row.copy()))
            return ready, logits

        engine.runner.execute = recording
        engine.recorder = self
        return self


def run_together(engine, prompts: list[list[int]], tag: str, params=GREEDY) -> list[Output]:
    recorder = getattr(engine, "recorder", None) or Recorder().attach(engine)
    ids = [engine.add_request(p, params, request_id=f"{tag}{i}").request_id for i, p in enumerate(prompts)]
    final = engine.run_to_completion()
    return [Output(final[i].token_ids, final[i].logprobs, torch.stack(recorder.rows.pop(i)),
                   final[i].metrics.num_cached_tokens) for i in ids]


def run_alone(engine, prompts: list[list[int]], tag: str) -> list[Output]:
    return [run_together(engine, [p], f"{tag}{i}-")[0] for i, p in enumerate(prompts)]


def assert_no_blocks_held(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.full.pool.num_free_blocks == engine.kv.num_blocks


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class NotBitIdentical(AssertionError):
    """Two runs that should agree bit for bit do not. The expected failures expect only this, so that
    any other failure of theirs (a run that did not do what it says) still fails."""


def assert_identical(expected: list[Output], got: list[Output]) -> None:
    assert len(got) == len(expected)
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if have.tokens != want.tokens:
            raise NotBitIdentical(
                f"prompt {i}: tokens differ from {first_difference(want.tokens, have.tokens)}")
        if have.logprobs != want.logprobs:
            raise NotBitIdentical(f"prompt {i}: logprobs differ")
        if not torch.equal(have.logits, want.logits):
            raise NotBitIdentical(
                f"prompt {i}: logits differ by up to {float((have.logits - want.logits).abs().max()):.3g}")


def assert_same_tokens_close_logits(expected: list[Output], got: list[Output]) -> None:
    """Token ids equal, or the first difference is a near-tie within the bound; the logits rows up to
    it within RECOMPUTED_LOGITS_ATOL."""
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        n = first_difference(want.tokens, have.tokens)
        diff = float((have.logits[: n + 1] - want.logits[: n + 1]).abs().max())
        assert diff < RECOMPUTED_LOGITS_ATOL, f"prompt {i}: logits differ by {diff:.3g}"
        if n < len(want.tokens):
            top = want.logits[n].topk(2).values
            gap = float(top[0] - top[1])
            assert gap < 2 * RECOMPUTED_LOGITS_ATOL, (
                f"prompt {i}: token {n} differs, no near-tie (gap {gap:.3g})"
            )
        assert len(have.tokens) == len(want.tokens) == NUM_NEW


# --- the modes: each returns its engine and the outputs, in prompt order ------------------------------

def batched(loaded, prompts):
    engine = make_engine(loaded, max_num_seqs=8, prefix_caching=False)
    return engine, run_together(engine, prompts, "batched")


def chunked(loaded, prompts, budget: int = 24):
    engine = make_engine(loaded, max_num_seqs=8, budget=budget, prefix_caching=False)
    return engine, run_together(engine, prompts, "chunked")


def prefix_cached(loaded, prompts):
    """Each prompt alone, twice, with the prefix cache: the second time every full block is a hit."""
    engine = make_engine(loaded, max_num_seqs=1, prefix_caching=True)
    first = run_alone(engine, prompts, "fill")
    engine.first_pass = first
    return engine, run_alone(engine, prompts, "hit")


def preempted(loaded, prompts):
    """Room for about two of the sequences at once: eight requests must preempt each other."""
    longest = max(len(p) for p in prompts) + NUM_NEW
    per_token = loaded.config.kv_size_per_token * 4
    room = per_token * 2 * (longest + 16)
    engine = make_engine(loaded, num_ctx=longest + 16, max_num_seqs=8, kv_cache_memory=room)
    return engine, run_together(engine, prompts, "preempted")


def forward_path(loaded, prompts):
    engine = make_engine(loaded, max_num_seqs=1, prefix_caching=False)
    engine.runner.native_step = None
    return engine, run_alone(engine, prompts, "forward")


def other_thread_count(loaded, prompts):
    threads = torch.get_num_threads()
    engine = make_engine(loaded, max_num_seqs=1, prefix_caching=False)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        return engine, run_alone(engine, prompts, "threads")
    finally:
        torch.set_num_threads(threads)


# --- SmolLM2 as served, f32 KV ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(smollm2_q4):
    """The model, six prompts and each prompt's output run alone (the baseline)."""
    prompts = prompts_for(smollm2_q4, 6)
    engine = make_engine(smollm2_q4, max_num_seqs=1, prefix_caching=False)
    baseline = run_alone(engine, prompts, "alone")
    assert_no_blocks_held(engine)
    return smollm2_q4, prompts, baseline, engine


def test_the_baseline_runs_the_served_kernels(served):
    loaded, _, baseline, engine = served
    downs = [layer.down for layer in loaded.model.layers]
    assert all(isinstance(down, Int4Linear) and down.kernel is not None for down in downs)
    assert native_paged.for_storage(engine.storage) is not None
    assert engine.runner.native_step.calls >= len(baseline) * (NUM_NEW - 1)
    assert all(len(o.tokens) == len(o.logprobs) == o.logits.shape[0] == NUM_NEW for o in baseline)


def test_batched_is_alone(served):
    loaded, prompts, baseline, _ = served
    engine, got = batched(loaded, prompts)
    assert engine.recorder.max_ready == len(prompts)
    assert_no_blocks_held(engine)
    assert_identical(baseline, got)


def test_chunked_prefill_is_whole(served):
    """Chunks of 24 tokens less the decode tokens beside them (none of a single token: see below)."""
    loaded, prompts, baseline, _ = served
    engine, got = chunked(loaded, prompts)
    assert engine.recorder.partial_prefills > 0 and engine.recorder.mixed_steps > 0
    assert engine.recorder.one_token_prompt_chunks == 0
    assert_no_blocks_held(engine)
    assert_identical(baseline, got)


def test_a_one_token_chunk_is_whole(served):
    """Each prompt in a chunk of all its tokens but the last, then that one (a budget of 16 with six prompts
    gives such chunks too)."""
    loaded, prompts, baseline, _ = served
    for i, p in enumerate(prompts[1:], start=1):
        engine = make_engine(loaded, max_num_seqs=1, budget=len(p) - 1, prefix_caching=False)
        got = run_together(engine, [p], f"one-token-chunk{i}-")
        assert engine.recorder.one_token_prompt_chunks == 1
        assert_identical(baseline[i : i + 1], got)


def test_prefix_cache_hits_are_misses(served):
    loaded, prompts, baseline, _ = served
    engine, got = prefix_cached(loaded, prompts)
    bs = engine.config.cache.block_size
    # every full block but the one holding the last prompt token (recomputed for its logits)
    assert [o.num_cached_tokens for o in got] == [(len(p) - 1) // bs * bs for p in prompts]
    assert any(o.num_cached_tokens for o in engine.first_pass)  # the shared prefix, the first time through
    assert_no_blocks_held(engine)
    assert_identical(baseline, engine.first_pass)
    assert_identical(baseline, got)


def test_forward_path_is_the_one_call_step(served):
    loaded, prompts, baseline, _ = served
    engine, got = forward_path(loaded, prompts)
    assert engine.runner.native_step is None and engine.recorder.max_ready == 1
    assert_identical(baseline, got)


def test_thread_count_changes_nothing(served):
    loaded, prompts, baseline, _ = served
    engine, got = other_thread_count(loaded, prompts)
    assert engine.runner.native_step.threads != torch.get_num_threads()  # planned for the other count
    assert_identical(baseline, got)


@pytest.fixture(scope="module")
def preempted_run(served):
    loaded, prompts, _, _ = served
    engine, got = preempted(loaded, prompts)
    assert engine.num_preemptions > 0
    assert_no_blocks_held(engine)
    return got


def test_preemption_gives_the_same_tokens(served, preempted_run):
    assert_same_tokens_close_logits(served[2], preempted_run)


@pytest.mark.xfail(strict=True, raises=NotBitIdentical,
                   reason="a preempted request's generated tokens are recomputed by the prefill attention "
                          "kernel, "
                   "which sums a row in another order than the decode kernel did")
def test_preemption_is_bit_identical(served, preempted_run):
    assert_identical(served[2], preempted_run)


@pytest.fixture(scope="module")
def second_turns(served):
    """A second turn that repeats the first prompt and its answer, then asks more: with the prefix
    cache its blocks are the decode steps' own, without it a prefill recomputes them."""
    loaded, prompts, baseline, _ = served
    rng = random.Random(1)
    turns = [
        p + o.tokens + [rng.randrange(3, 5000) for _ in range(10)] for p, o in zip(
            prompts[:3], baseline, strict=False)]
    cached = make_engine(loaded, max_num_seqs=1, prefix_caching=True)
    run_alone(cached, prompts[:3], "turn1-")
    with_cache = run_alone(cached, turns, "turn2-")
    assert all(
        o.num_cached_tokens >= len(p) + NUM_NEW - 16 for o, p in zip(with_cache, prompts, strict=False))
    without = run_alone(make_engine(loaded, max_num_seqs=1, prefix_caching=False), turns, "turn2-")
    return without, with_cache


def test_second_turn_gives_the_same_tokens_with_and_without_the_prefix_cache(second_turns):
    assert_same_tokens_close_logits(*second_turns)


@pytest.mark.xfail(strict=True, raises=NotBitIdentical,
                   reason="without the prefix cache the first answer's tokens are recomputed by the prefill "
                   "attention kernel, which sums a row in another order than the decode kernel did")
def test_second_turn_is_bit_identical_with_and_without_the_prefix_cache(second_turns):
    assert_identical(*second_turns)


# --- the tiny random model, f32 weights: token ids --------------------------------------------------------

TINY_MODES = {"batched": batched, "chunked": chunked, "prefix_cached": prefix_cached, "preempted": preempted,
              "forward_path": forward_path}


@pytest.fixture(scope="module")
def tiny_baseline(tiny_llama):
    prompts = prompts_for(tiny_llama, 8)
    baseline = run_alone(make_engine(tiny_llama, max_num_seqs=1, prefix_caching=False), prompts, "alone")
    return tiny_llama, prompts, baseline


def test_tiny_alone_matches_the_contiguous_reference(tiny_baseline):
    loaded, prompts, baseline = tiny_baseline
    for p, o in zip(prompts, baseline, strict=False):
        assert_same_or_near_tie(loaded, p, reference_greedy(loaded, p, NUM_NEW), o.tokens)


@pytest.mark.parametrize("mode", list(TINY_MODES))
def test_tiny_modes_give_the_same_tokens(tiny_baseline, mode):
    loaded, prompts, baseline = tiny_baseline
    engine, got = TINY_MODES[mode](loaded, prompts)
    if mode == "preempted":
        assert engine.num_preemptions > 0
    assert_no_blocks_held(engine)
    assert [o.tokens for o in got] == [o.tokens for o in baseline]

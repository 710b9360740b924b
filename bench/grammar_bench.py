"""Constrained decoding: what it costs, and the measurement behind the choice of library.

Part 1, the libraries on our tokenizers: tokenizer tables, schema compilation, and the time of one
token mask (p50/p99) while a valid JSON document is consumed token by token. xgrammar is measured
when installed (``pip install --no-deps xgrammar apache-tvm-ffi``); kvserve uses llguidance.
Part 2, the engine: decode tok/s of the same requests with and without a JSON-schema constraint
(greedy, one stream and 8 at once), and the mask time per token seen inside the sampler.

    .venv/bin/python bench/grammar_bench.py [--models smollm2,gemma3-270m] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.constraints import Constraint
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.gguf_file import GGUFFile
from kvserve.models.registry import resolve
from kvserve.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace, countess", "age": 36, "tags": ["math", "poetry"],
                       "city": "Paris"})


def percentiles(seconds: list[float]) -> str:
    s = sorted(seconds)
    return f"p50 {statistics.median(s) * 1e6:.0f} us, p99 {s[int(0.99 * (len(s) - 1))] * 1e6:.0f} us"


def llguidance_row(tok: Tokenizer, ids: list[int]) -> str:
    from llguidance import LLMatcher, LLTokenizer

    t0 = time.perf_counter()
    lt = LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids[0])
    t1 = time.perf_counter()
    matcher = LLMatcher(lt, LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    words = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    times = []
    for t in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        times.append(time.perf_counter() - start)
        assert (words[t // 32] >> (t % 32)) & 1 and matcher.consume_token(t)
    return f"tables {1e3 * (t1 - t0):.0f} ms, compile {1e3 * (t2 - t1):.1f} ms, mask {percentiles(times)}"


def xgrammar_row(tok: Tokenizer, ids: list[int]) -> str:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return "not installed"
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size,
                                                                       stop_token_ids=tok.eos_token_ids))
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - start)
        assert (int(bitmask[0, t // 32]) >> (t % 32)) & 1 and matcher.accept_token(t)
    return f"tables {1e3 * (t1 - t0):.0f} ms, compile {1e3 * (t2 - t1):.1f} ms, mask {percentiles(times)}"


def decode_rate(engine: LLMEngine, prompt: list[int], params: SamplingParams, streams: int) -> tuple[
    float, list]:
    """(aggregate decode tok/s, the sampler's mask times) of ``streams`` copies of one request."""
    ids = [engine.add_request(prompt, params).request_id for _ in range(streams)]
    final = engine.run_to_completion()
    masks = [t for i in ids for t in final[i].metrics.mask_times]
    return sum(final[i].metrics.decode_tok_s or 0.0 for i in ids), masks


def engine_rows(name: str, tokens: int) -> None:
    config = EngineConfig(model=name, cache=CacheConfig(16, 1024, None, False, "f16", None),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    engine = LLMEngine.from_config(config)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    # a schema whose strings may run as long as free text does, so both runs decode `tokens` tokens
    long_schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    bound = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                           constraint=Constraint.json_schema(long_schema))
    decode_rate(engine, prompt, bound, 1)  # builds the grammar tables once
    for streams in (1, 8):
        rates, masks = [], []
        for params in (free, bound, free, bound):  # alternating: the machine drifts
            rate, times = decode_rate(engine, prompt, params, streams)
            rates.append(rate)
            masks += times
        unconstrained, constrained = (rates[0] + rates[2]) / 2, (rates[1] + rates[3]) / 2
        print(
            f"  {name}, {streams} stream(s): decode {unconstrained:.1f} tok/s free, {constrained:.1f} "
            f"constrained "
              f"({100 * constrained / unconstrained:.0f}%); sampler mask {percentiles(masks)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    names = args.models.split(",")
    for name in names:
        tok = Tokenizer.from_gguf(GGUFFile(resolve(name)))
        ids = tok.encode(DOCUMENT, add_special=False)
        print(f"{name} ({tok.vocab_size} tokens), {len(ids)} masks:")
        print(f"  llguidance: {llguidance_row(tok, ids)}")
        print(f"  xgrammar:   {xgrammar_row(tok, ids)}")
    for name in names:
        engine_rows(name, args.tokens)


if __name__ == "__main__":
    main()

"""Speculative decoding by prompt lookup against plain decoding, in one engine process.

    .venv/bin/python bench/speculative.py [--model smollm2] [--k 2,4,8] [--streams 1,4] [--json out.json]

Workloads: ``repeat`` (a paragraph, twice, then its first words: the model goes on repeating it, as an
edit or a quote of the input does), ``code`` (a file of similar functions to continue), ``code-edit``
(a chat request to rewrite a ~1,100-token module of this package with one function renamed: the answer
copies most of the file) and ``chat`` (a question answered in free text: little to look up). For each: decode
tok/s with speculation off and with ``k`` drafts per step, alternating, the median of ``--runs``; the ratio;
the share of drafts kept and the tokens each verifying step emitted; what a step's one more row costs over a
step of one (``row_cost``, fitted over the timed steps) and the ratio it allows with every draft kept
(``all_kept_bound``). The output is checked to be the same tokens. ``--max-tokens 1024`` measures
``code-edit``'s whole answer, not its first 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from decode_rate import decode_rate

import kvserve
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model

PARAGRAPH = (
    "The KV cache is a preallocated pool of fixed-size blocks with block tables; full blocks are hashed "
             "so later requests with the same prefix reuse them, from RAM and from disk across restarts. ")
CODE = "".join(
    f"def scale_{n}(values):\n    return [v * {n} for v in values]\n\n" for n in range(2, 7)) + "def scale_7("


def code_edit_request() -> str:
    source = (Path(kvserve.__file__).parent / "kv" / "hashing.py").read_text()
    return (
        f"Here is a Python module:\n\n```python\n{source}```\n\nRewrite the whole module with the function "
            "`extend_block_hashes` renamed to `grow_block_hashes`. Reply with the complete module only.")


def workloads(tokenizer) -> dict[str, list[int]]:
    return {
        "repeat": tokenizer.encode(PARAGRAPH * 2 + PARAGRAPH[:40]),
        "code": tokenizer.encode(CODE),
        "code-edit": tokenizer.encode_chat([{"role": "user", "content": code_edit_request()}]),
        "chat": tokenizer.encode_chat([{"role": "user",
                                        "content": "Why is the sky blue? Answer in a paragraph."}]),
    }


def decode(loaded, model: str, prompt: list[int], streams: int, k: int, max_tokens: int):
    cache = CacheConfig(num_ctx=max(2048, len(prompt) + max_tokens), cache_type_k="f16")
    config = EngineConfig(model, cache, SchedulerConfig(max_num_seqs=streams))
    if k:
        config = replace(config, speculative=SpeculativeConfig("ngram", k))
    engine = LLMEngine(config, loaded)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params).request_id for _ in range(streams)]
    steps = timed_decode_steps(engine)
    rate, done = decode_rate(engine)
    return rate, [done[i].token_ids for i in ids], engine, steps


def timed_decode_steps(engine) -> list[tuple[int, float]]:
    """(rows, seconds) of each forward the engine runs from now on where every request decodes (a
    verify step has a row per draft)."""
    steps = []
    execute = engine.runner.execute

    def timed(out):
        decoding = all(s.request.num_computed_tokens >= s.request.num_prompt_tokens for s in out.scheduled)
        start = time.perf_counter()
        result = execute(out)
        if decoding:
            steps.append((sum(s.num_new_tokens for s in out.scheduled), time.perf_counter() - start))
        return result

    engine.runner.execute = timed
    return steps


def row_cost(steps: list[tuple[int, float]]) -> float | None:
    """What one more row costs over a step of one, fitted as seconds = b + c (rows - 1): c / b. With
    every draft kept, k drafts a step give at most (k + 1) / (1 + k c / b) times the plain rate."""
    extra = [rows - 1 for rows, _ in steps]
    if len(set(extra)) < 2:
        return None
    slope, intercept = statistics.linear_regression(extra, [seconds for _, seconds in steps])
    return slope / intercept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", default="2,4,8")
    p.add_argument("--streams", default="1,4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--workloads", default="repeat,code,code-edit,chat")
    p.add_argument("--weights", default="auto", help="weight format (auto: q4 for a GGUF)")
    args = p.parse_args()
    loaded = load_model(args.model, weight_format=args.weights)
    rows = []
    chosen = args.workloads.split(",")
    for name, prompt in workloads(loaded.tokenizer).items():
        if name not in chosen:
            continue
        for streams in map(int, args.streams.split(",")):
            for k in map(int, args.k.split(",")):
                off, on, timed = [], [], []
                for _ in range(args.runs):
                    rate, expected, _, _ = decode(loaded, args.model, prompt, streams, 0, args.max_tokens)
                    off.append(rate)
                    rate, got, engine, step_times = decode(loaded, args.model, prompt, streams, k,
                                                           args.max_tokens)
                    on.append(rate)
                    timed += step_times
                    if got != expected:
                        raise SystemExit(f"{name}, k={k}: speculation changed the output")
                steps = max(1, engine.num_verify_steps)
                cost = row_cost(timed)
                rows.append({"workload": name, "weights": args.weights, "streams": streams, "k": k,
                             "tok_s_off": statistics.median(off), "tok_s_on": statistics.median(on),
                             "ratio": statistics.median(on) / statistics.median(off),
                             "accepted_share": engine.num_accepted_tokens / max(1, engine.num_draft_tokens),
                             "tokens_per_verify_step": (engine.num_accepted_tokens + steps) / steps,
                             "row_cost": cost,
                             "all_kept_bound": None if cost is None else (k + 1) / (1 + k * cost)})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

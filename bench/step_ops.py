"""Where a native step's time goes, by kernel, for several KV cache types side by side in one process.

End-to-end rows (``kvserve bench``) on a 2-core VM move by 5-30% between runs, so a KV type that costs 1%
of a decode step cannot be seen there. Here one engine per KV type shares the process and the machine's
state, the workloads run in turn (A B A B ...), and every operation of ``native/model_step.c``'s list is
called on its own (the same kernels, the same order, so the same bits) and timed: the sum per operation kind
and phase (prefill steps, decode steps) says which kernel a type makes slower or faster. Each call pays the
same ~3 us of ctypes on either side, so compare kinds across types, not the totals with an unprofiled step.

    .venv/bin/python bench/step_ops.py qwen2.5-coder-0.5b --prompt 128 --gen 64 --types f16,q8_0 --repeats 4
"""

from __future__ import annotations

import argparse
import collections
import random
import time

import torch

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models import native_step
from kvserve.models.loader import load_model
from kvserve.native import abi


def _hook_steps(streams: int) -> list[collections.Counter]:
    """From now on every native step runs its operations one call each, timed into the first Counter of the
    returned list (phase, operation kind) -> ns; swap that Counter to time another engine."""
    constants = abi.header().constants
    fields = constants["OP_FIELDS"]
    names = {v: k.removeprefix("OP_") for k, v in constants.items()
             if k.startswith("OP_") and k != "OP_FIELDS"}
    step = native_step._step_function()
    kinds_of: dict[int, list[int]] = {}  # an operation list's address -> its operations' kinds
    current = [collections.Counter()]

    def one_by_one(ops, num_ops, n, *rest):
        phase = "prefill" if n > streams else "decode"
        for i, kind in enumerate(kinds_of[ops][:num_ops]):
            start = time.perf_counter_ns()
            failed = step(ops + i * fields * 8, 1, n, *rest)
            current[0][(phase, names[kind])] += time.perf_counter_ns() - start
            if failed:
                return i + 1
        return 0

    plan = native_step.NativeStep._plan

    def planned(self, *a):
        plan(self, *a)
        kinds_of[self.ops.ctypes.data] = self.ops[:, 0].tolist()

    native_step._step_function = lambda: one_by_one
    native_step.NativeStep._plan = planned
    return current


def _report(args, times: dict[str, collections.Counter]) -> None:
    names = list(times)
    print(f"{args.model}, prompt {args.prompt}, {args.gen} new tokens, {args.streams} stream(s), "
          f"{args.repeats} repeats; ms summed over all steps")
    print(f"{'phase':8s} {'operation':28s} " + " ".join(f"{n:>12s}" for n in names)
          + (f" {names[-1] + ' / ' + names[0]:>14s}" if len(names) > 1 else ""))
    for key in sorted(set().union(*times.values())):
        ms = [times[n][key] / 1e6 for n in names]
        ratio = f" {ms[-1] / ms[0]:14.2f}" if len(names) > 1 and ms[0] > 0 else ""
        print(f"{key[0]:8s} {key[1]:28s} " + " ".join(f"{m:12.1f}" for m in ms) + ratio)
    for phase in ("prefill", "decode"):
        ms = [sum(t for k, t in times[n].items() if k[0] == phase) / 1e6 for n in names]
        print(f"{phase:8s} {'all':28s} " + " ".join(f"{m:12.1f}" for m in ms))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--types", default="f16,q8_0", help="KV types (K/V pairs as K/V)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    current = _hook_steps(args.streams)

    loaded = load_model(args.model, auto_pull=True, weight_format="auto")
    engines, times = {}, {}
    for name in args.types.split(","):
        k, _, v = name.partition("/")
        cache = CacheConfig(num_ctx=args.prompt + args.gen + 16, cache_type_k=k, cache_type_v=v or k)
        engines[name] = LLMEngine(EngineConfig(model=str(loaded.path), cache=cache,
                                               scheduler=SchedulerConfig(max_num_seqs=args.streams)), loaded)
        times[name] = collections.Counter()
    rng = random.Random(0)
    vocab = min(loaded.config.vocab_size, 32000)
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    for _ in range(args.repeats):
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt)] for _ in range(args.streams)]
        for name, engine in engines.items():  # the same prompts for every type, in turn
            current[0] = times[name]
            for prompt in prompts:
                engine.add_request(prompt, params)
            engine.run_to_completion()
    _report(args, times)


if __name__ == "__main__":
    main()

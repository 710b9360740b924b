"""What `kvserve plan` predicts against what a process measures: for each model and context, a fresh
process loads the model (the engine's default weights), makes an engine of that context (one sequence,
f16 KV), runs a prompt that fills it, and reports its peak resident size (VmHWM: the load's peak or the
request's, whichever is higher); the plan's engine total (`total (engine)`) for the same settings beside it.

    .venv/bin/python bench/plan_vs_rss.py [--models smollm2,gemma3-270m] [--ctx 2048,8192]

Linux only (/proc/self/status). A memory target is a benchmark, not a test: the C library's heap and
the OS's page cache make the figure the machine's as much as ours.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

RUN = """
import sys
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model

model, ctx = sys.argv[1], int(sys.argv[2])
loaded = load_model(model, weight_format="auto")
config = EngineConfig(model=model, cache=CacheConfig(16, ctx, None, True, "f16", "f16"),
                      scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512))
engine = LLMEngine(config, loaded)
prompt = [(1000 + 7 * i) % 30000 + 100 for i in range(ctx - 32)]
engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
engine.run_to_completion()
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024)
"""


def planned(model: str, ctx: int) -> int:
    out = subprocess.run([sys.executable, "-m", "kvserve", "plan", model, "-c", str(ctx), "--json"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    return json.loads(out)["kv_types"][0]["contexts"][0]["engine_total_bytes"]


def measured(model: str, ctx: int) -> int:
    r = subprocess.run([sys.executable, "-c", RUN, model, str(ctx)], capture_output=True, text=True,
                       timeout=3600, check=False)
    if r.returncode != 0:
        raise SystemExit(r.stderr.strip().splitlines()[-1])
    return int(r.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--ctx", default="2048,8192")
    args = p.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("reads /proc/self/status: Linux only")
    print(f"{'model':<14} {'ctx':>7} {'planned MiB':>12} {'peak RSS MiB':>13} {'planned / measured':>19}")
    for model in args.models.split(","):
        for ctx in (int(c) for c in args.ctx.split(",")):
            plan, peak = planned(model, ctx), measured(model, ctx)
            print(f"{model:<14} {ctx:>7} {plan / 2**20:>12.1f} {peak / 2**20:>13.1f} {plan / peak:>19.3f}")


if __name__ == "__main__":
    main()

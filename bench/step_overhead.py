"""The host's cost of an engine step: decode steps of one stream on a tiny random Llama (hidden 256, two
layers, q4 weights, the one-call step), where the kernels take microseconds and the Python and library
calls around them are most of the step. Compare two commits by running this at each, alternately.

    .venv/bin/python bench/step_overhead.py [--tokens 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' tiny model writer
from tests.support import write_tiny_llama


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    path = write_tiny_llama(Path(tempfile.mkdtemp()), seed=1, hidden=256)
    loaded = load_model(str(path), weight_format="q4")
    engine = LLMEngine(EngineConfig(model=str(path), cache=CacheConfig(num_ctx=1024, cache_type_k="f16"),
                                    scheduler=SchedulerConfig(max_num_seqs=1)), loaded)
    if engine.runner.native_step is None:
        raise SystemExit("the one-call step does not run here (no kernels?)")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    per_step = []
    for r in range(args.repeats):
        engine.add_request([1, 5, 9, 13], params, request_id=f"r{r}")
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        per_step.append((time.perf_counter() - start) / steps)
    print(f"ms per step: best {min(per_step) * 1e3:.3f}, all "
          + " ".join(f"{s * 1e3:.3f}" for s in per_step))


if __name__ == "__main__":
    main()

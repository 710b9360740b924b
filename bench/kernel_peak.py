"""Each weight type's prefill matmul as a share of the CPU's int8 peak, on the models' own tensors:

    .venv/bin/python bench/kernel_peak.py [MODEL ...] [--rows 512] [--rounds 9] [--weights q4-fast,q4]
                                          [--ghz 3.5]

For every GGUF type a model's layers are made of (one tensor per type and model, the largest), one call of
its kernel on ``--rows`` random activation rows. Every case is timed once a round, all cases in turn, for
``--rounds`` rounds (the machine's drift lands on all alike); the table shows the fastest round (the
kernel's capability, what the share of the peak is about) and the median. The useful work is
rows x out x in multiply-adds; ``q4`` (exact) weights split each activation into two int8 digits and do
twice the integer products (the ``int MAC/s`` column counts those).

The peak is computed, not measured: int8 multiply-adds per cycle per core for the path the kernels run
(an upper bound from instruction throughput: AVX2 ``vpmaddubsw`` + ``vpmaddwd`` on two vector multiply
ports = 32; AVX-VNNI ``vpdpbusd`` ymm x 2 = 64; AVX-512 VNNI zmm x 2 = 128; NEON ``sdot`` 4 x 16 = 64;
what a core really issues may be half of it), times the threads, times the clock (``--ghz``, else the
CPU's reported maximum, else its current "cpu MHz": a VM reports its nominal clock, not the boost).
AMX (1,024 per cycle per core) is listed for a CPU that has it; no kernel of ours uses it yet. Q8_0
tensors run ``int8_matmul.c``'s exact 16-bit activations (``vpmaddwd``: half the products an instruction
of the 8-bit path), so their share counts against a peak they cannot reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

from kvserve import native
from kvserve.models.layouts import GGUF_LAYOUTS, QL_F32
from kvserve.models.linear import Int4Linear, Int8GroupLinear, StackedLinear
from kvserve.models.loader import load_model

MACS_PER_CYCLE = {"avx512vnni": 128, "avxvnni": 64, "avx2": 32, "sdot": 64, "neon": 16, "portable": 8}
AMX_MACS_PER_CYCLE = 1024
LAYOUT_NAMES = {layout: name for name, (layout, _, _) in GGUF_LAYOUTS.items()}


def clock_ghz() -> tuple[float, str]:
    """The CPU's maximum clock from lscpu, else /proc/cpuinfo's current one, and which it was."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("CPU max MHz:"):
                return float(line.split(":")[1]) / 1e3, "lscpu max"
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1e3, "cpuinfo current"
    raise SystemExit("no clock found: pass --ghz")


def type_name(lin) -> str:
    """The GGUF type whose grid a projection holds (QL_F16 is Q4_1's; QL_F32 a 4-bit grid of no file type)."""
    if isinstance(lin, Int8GroupLinear):
        return "Q8_0" if lin.layout == "g32" else "int8 g16"
    return "4-bit f32 scales" if lin.layout == QL_F32 else LAYOUT_NAMES[lin.layout]


def by_type(model) -> dict[str, object]:
    """The largest projection of each weight type in the model's layers."""
    found: dict[str, object] = {}
    for layer in model.layers:
        for lin in layer.linears:
            for part in lin.parts if isinstance(lin, StackedLinear) else [lin]:
                if not isinstance(part, Int4Linear | Int8GroupLinear) or part.kernel is None:
                    continue
                name = type_name(part)
                old = found.get(name)
                if old is None or part.out_features * part.in_features > old.out_features * old.in_features:
                    found[name] = part
    return found


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--weights", default="q4-fast,q4")
    ap.add_argument("--ghz", type=float)
    args = ap.parse_args()
    ghz, source = (args.ghz, "--ghz") if args.ghz else clock_ghz()
    threads = torch.get_num_threads()
    isa = native.isa()
    peak = MACS_PER_CYCLE[isa] * threads * ghz
    with open("/proc/cpuinfo") as f:
        amx = any(line.startswith("flags") and "amx_int8" in line.split() for line in f)
    print(f"{native.cpu_model()}; path {isa}; {threads} threads; {ghz:.2f} GHz ({source}); int8 peak "
          f"{peak:.0f} GMAC/s ({MACS_PER_CYCLE[isa]} per cycle per core)"
          + (f"; AMX {AMX_MACS_PER_CYCLE * threads * ghz:.0f} GMAC/s" if amx else ""))
    print(f"{'model':20s} {'weights':8s} {'type':16s} {'out x in':>12s} {'best ms':>8s} {'median':>8s} "
          f"{'GMAC/s':>8s} {'int GMAC/s':>10s} {'% peak':>7s}")
    g = torch.Generator().manual_seed(0)
    cases = []  # (model, weights, type, linear, x, out)
    for name in args.models:
        for weights in args.weights.split(","):
            model = load_model(name, "cpu", weight_format=weights).model
            for kind, lin in sorted(by_type(model).items()):
                cases.append((name, weights, kind, lin, torch.randn(args.rows, lin.in_features, generator=g),
                              torch.empty(args.rows, lin.out_features)))
    times: list[list[float]] = [[] for _ in cases]
    for case in cases:  # once each before the rounds: first-touch pages, the kernels loaded
        case[3].into(case[4], case[5])
    for _ in range(args.rounds):
        for case, samples in zip(cases, times, strict=True):
            samples.append(timed(lambda c=case: c[3].into(c[4], c[5])))
    for (name, weights, kind, lin, _, _), samples in zip(cases, times, strict=True):
        best = min(samples)
        macs = args.rows * lin.out_features * lin.in_features / best / 1e9
        digits = getattr(lin, "digits", 1)
        print(f"{name:20s} {weights:8s} {kind:16s} {lin.out_features:>5d} x {lin.in_features:<5d} "
              f"{best * 1e3:8.2f} {statistics.median(samples) * 1e3:8.2f} {macs:8.1f} {macs * digits:10.1f} "
              f"{100 * macs * digits / peak:6.1f}%")

if __name__ == "__main__":
    os.environ.setdefault("KVSERVE_LOG", "warning")
    main()

"""The integer kernels on every instruction-set path this CPU runs, alternating in one process
(SmolLM2's shapes: one layer's four 4-bit projections, and the output head):

    .venv/bin/python bench/kernel_bench.py [--rows 1,16,512] [--repeats 7] [--isa avx2,portable]

Each path is its own build (``KVSERVE_ISA``); ms per call are medians over the repeats, the paths
interleaved so that the machine's drift lands on all of them alike.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from kvserve import native
from kvserve.models.weight_grids import int8_groups, pack_int4, pack_int8_groups

# SmolLM2-135M: hidden 576, 3 x 192 kv + 576 q, intermediate 1536, vocabulary 49152
PROJECTIONS = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]
HEAD = (49152, 576)


def build(isa: str) -> tuple:
    """(int4_matmul, int8_matmul) of the ``isa`` build."""
    os.environ["KVSERVE_ISA"] = isa
    native.load.cache_clear()
    native.function.cache_clear()
    p, i = ctypes.c_void_p, ctypes.c_int
    int4 = native.function("int4_matmul", "int4_matmul", (p, p, p, i, i, i, p, i, i, i, i), i)
    int8 = native.function("int8_matmul", "int8_matmul", (p, p, p, i, i, i, p, i, i), i)
    if int4 is None or int8 is None:
        raise SystemExit(f"no {isa} build on this machine")
    return int4, int8


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def measure_rows(m: int, layer: list, head: torch.Tensor, kernels: dict, threads: int, repeats: int,
                 g) -> dict:
    """{path: [layer q4 ms samples, layer q4-fast, head]} for m rows, three rounds of the paths in turn."""
    x4 = [torch.randn(m, k, generator=g) for _, _, k in layer]
    y4 = [torch.empty(m, n) for _, n, _ in layer]
    xh, yh = torch.randn(m, HEAD[1], generator=g), torch.empty(m, HEAD[0])
    results: dict[str, list[list[float]]] = {isa: [[], [], []] for isa in kernels}

    def projections(int4, digits: int) -> None:
        for (w, n, k), x, y in zip(layer, x4, y4, strict=True):
            int4(x.data_ptr(), w.data_ptr(), None, m, n, k, y.data_ptr(), threads, digits, 0, 0)

    def output_head(int8) -> None:
        int8(xh.data_ptr(), head.data_ptr(), None, m, HEAD[0], HEAD[1], yh.data_ptr(), threads, 0)

    for _ in range(3):
        for isa, (int4, int8) in kernels.items():
            results[isa][0].append(timed(lambda f=int4: projections(f, 2), repeats))
            results[isa][1].append(timed(lambda f=int4: projections(f, 1), repeats))
            results[isa][2].append(timed(lambda f=int8: output_head(f), repeats))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,512")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--isa", default=",".join(native.runnable_isas()))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    layer = [(pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                        torch.rand(n, k // 32) / 50, -torch.rand(n, k // 32) / 10), n,
                        k) for n, k in PROJECTIONS]
    head = pack_int8_groups(*int8_groups(torch.randn(*HEAD, generator=g) / 20))
    isas = args.isa.split(",")
    kernels = {isa: build(isa) for isa in isas}
    print(f"CPU paths {', '.join(isas)}; {args.threads} threads; ms per call, median of {args.repeats}")
    for m in (int(r) for r in args.rows.split(",")):
        results = measure_rows(m, layer, head, kernels, args.threads, args.repeats, g)
        for isa in isas:
            q4, fast, hd = (statistics.median(r) for r in results[isa])
            print(f"rows {m:4d}  {isa:11s} layer q4 {q4:8.3f}  q4-fast {fast:8.3f}  head {hd:8.3f}")


if __name__ == "__main__":
    main()

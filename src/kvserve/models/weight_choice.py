"""What ``--weights auto`` picks for a model on this machine, and why (said in the startup log,
``run --json`` and bench rows).

    device / file                                   auto      why
    not a CPU, or an HF folder                      f32       the integer kernels are the CPU's
    a CPU with a fused integer dot product          q4        exact activations (two int8 digits) cost little
      (AVX-512 VNNI, AVX-VNNI, NEON sdot)
    a CPU without one (AVX2, NEON without sdot),    q4-fast   llama.cpp's activations (one int8 code per 32),
      a file whose q4-fast KLD is measured at                 half the integer products
      most llama.cpp's on it
    a CPU without one, any other file               q4        no measurement says q4-fast loses no more
                                                              than llama.cpp does: exact

The measurement is bench/weight_quality.py's (KLD against f32 weights over 1,024 tokens, q4-fast and
llama.cpp on the same file); the registry records its verdict per model (``RegistryEntry.fast_kld_ok``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FUSED_DOT_PATHS = ("avx512vnni", "avxvnni", "neon-dotprod")


@dataclass(frozen=True, slots=True)
class WeightChoice:
    format: str
    why: str


def fused_integer_dot(isa: str) -> bool:
    return isa in FUSED_DOT_PATHS


def fast_measured(path: Path) -> str | None:
    """The registry model whose installed file is ``path`` and whose q4-fast KLD was measured at most
    llama.cpp's, or None."""
    from kvserve.models.registry import REGISTRY, installed_path

    for entry in REGISTRY.values():
        installed = installed_path(entry, assemble=False) if entry.fast_kld_ok else None
        if installed is not None and installed.resolve() == path.resolve():
            return entry.name
    return None


def choose(path: Path, device_type: str, isa: str) -> WeightChoice:
    """``--weights auto`` for the model at ``path`` on ``device_type`` with the kernels built for ``isa``
    (``native.kernel_path()``: "torch" where none could be built)."""
    if device_type != "cpu" or path.is_dir():
        return WeightChoice("f32", f"{'an HF folder' if path.is_dir() else device_type}: f32 weights")
    if isa == "torch" or fused_integer_dot(isa):
        reason = ("no C compiler: torch's kernels" if isa == "torch"
                  else f"{isa} has a fused integer dot product: exact activations")
        return WeightChoice("q4", reason)
    measured = fast_measured(path)
    if measured:
        return WeightChoice("q4-fast",
                            f"{isa} has no fused integer dot product and {measured}'s q4-fast KLD is "
                                       "measured at most llama.cpp's: llama.cpp's int8 activations")
    return WeightChoice("q4", f"{isa} has no fused integer dot product, but no measurement puts this file's "
                              "q4-fast KLD at or under llama.cpp's: exact (--weights q4-fast opts in)")

"""Loads the C kernels of this directory with ctypes: prebuilt for the CPU's path, else built on first use.

A wheel carries one library per kernel and instruction-set path of its architecture (simd.h's paths:
``avx512vnni``, ``avxvnni``, ``avx2``, ``portable`` on x86-64; ``neon``, ``portable`` on aarch64), built by
``prebuild`` when the wheel is made (setup.py). At run time ``load`` takes the fastest prebuilt path this
CPU runs, as llama.cpp's backend loader picks among its CPU variants, so a machine with no C compiler
runs the kernels. A prebuilt library counts only while it was built from exactly the sources, headers
and flags beside it (``source_key``, written in the manifest): a source checkout that edits a kernel
compiles it again.

Where no prebuilt library fits (a source or editable install, a CPU of no shipped path) the first call
compiles the source with the machine's C compiler (``$CC``, else ``cc``/``gcc``) for this exact CPU
(``-march=native``) into a cache directory, later calls load the cached library. ``KVSERVE_ISA`` asks
for one path instead (simd.h): ``avx512vnni``, ``avxvnni``, ``avx2``, ``neon`` or ``portable``, prebuilt
or compiled for that path's baseline, so that every path can be built, tested and measured on a machine
that runs it; ``kernel_path()`` names the path in use and ``choices()`` says which library each kernel
loaded and why (``kvserve doctor``). The library links OpenMP's ``libgomp.so.1``, the runtime torch
itself loaded, so the kernels share torch's threads instead of fighting them for the cores.

Without a library (no prebuilt one fits and no compiler, or ``KVSERVE_NATIVE=0``) ``load`` returns None
and callers keep their torch path; the reason is logged once.

Every exported function is declared once, in ``kernels.h``, which every source includes. ``function``
hands out one function of a library with the ctypes signature ``abi`` reads from that declaration, so
no argument list is written again in Python.

    prebuilt:  <package>/native/prebuilt/<isa>/<name>.so, manifest.json: {"<isa>/<name>": source_key}
    compiled:  cache key = sha256(source_key, compiler version, CPU flags)
               -> <cache>/<name>-<key>.so
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvserve.native import abi

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
PREBUILT_DIR = SOURCE_DIR / "prebuilt"
MANIFEST = "manifest.json"
# Not -ffast-math: for shared objects gcc then links crtfastmath.o, which flushes denormals to zero
# for the whole process. These flags allow only what the loops need to vectorize (reordered sums).
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]
# The integer kernels give the same bits on every path and compiler: their float steps are explicit
# fused multiply-adds in a fixed order, so no multiply and add may be fused, nor an expression
# re-associated (clang turned x * (127 / m) into (x * 127) / m), on one build and not another.
# rope.c rounds as torch's formula does, each product and sum apart.
EXACT_FLOAT = ["-ffp-contract=off", "-fno-associative-math"]
SOURCE_FLAGS = {"int4_matmul": EXACT_FLOAT, "int8_matmul": EXACT_FLOAT, "rope": ["-ffp-contract=off"]}

# The instruction-set paths of simd.h: the flags that build each, and the CPU features (of
# /proc/cpuinfo's flags or, on ARM, Features) that run it.
ISA_FLAGS = {
    "avx512vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"],
    "avxvnni": ["-march=x86-64-v3", "-mavxvnni", "-mtune=generic"],
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "neon": ["-march=armv8.2-a+dotprod"],
    "portable": ["-DKVSERVE_PORTABLE"],
}
ISA_NEEDS = {
    "avx512vnni": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"},
    "avxvnni": {"avx_vnni", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "neon": {"asimd", "asimddp"},
    "portable": set(),
}
# The paths a wheel for each machine type carries (each must compile on that machine's gcc/clang).
ARCH_ISAS = {
    "x86_64": ("avx512vnni", "avxvnni", "avx2", "portable"),
    "aarch64": ("neon", "portable"),
}


@dataclass(frozen=True, slots=True)
class Choice:
    """Which library a kernel loaded: ``how`` is "prebuilt", "compiled" (this process built it) or
    "cached" (an earlier build of the same key); ``isa`` its path ("native": -march=native)."""

    kernel: str
    isa: str
    how: str
    path: str
    why: str


_choices: dict[str, Choice] = {}


def choices() -> dict[str, Choice]:
    """The library each kernel loaded so far in this process, by kernel name."""
    return dict(_choices)


def cache_root() -> Path:
    """kvserve's cache directory: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve (~/.cache/kvserve)."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"))


def cache_dir() -> Path:
    return cache_root() / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpuinfo_line(keys: tuple[str, ...]) -> str:
    """The first line of /proc/cpuinfo that starts with one of ``keys`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(keys)), "")
    except OSError:
        return ""


def _cpu_flags() -> str:
    return _cpuinfo_line(("flags", "Features"))  # x86, ARM


def cpu_model() -> str:
    """The CPU's name as the OS reports it (x86: "model name"; ARM: the CPU part), or the machine type."""
    import platform

    return _cpuinfo_line(("model name", "Model", "CPU part")).partition(":")[2].strip() or (
        platform.processor() or platform.machine())


def runnable_isas() -> list[str]:
    """The paths of ISA_FLAGS this CPU runs, fastest first; portable always."""
    have = set(_cpu_flags().partition(":")[2].split())
    return [name for name, needs in ISA_NEEDS.items() if needs <= have]


def requested_isa() -> str | None:
    """KVSERVE_ISA, checked: None (build for this CPU) when unset or ``native``."""
    name = os.environ.get("KVSERVE_ISA", "").strip().lower()
    if name in ("", "native", "auto"):
        return None
    if name not in ISA_FLAGS:
        raise ValueError(f"KVSERVE_ISA={name!r}: use one of native, {', '.join(ISA_FLAGS)}")
    return name


def isa() -> str:
    """The path the kernels are built for: KVSERVE_ISA's, else the fastest this CPU runs."""
    return requested_isa() or runnable_isas()[0]


def kernel_path() -> str:
    """The path the CPU kernels run on now: the int4 matmul's library's path (``isa()`` where it was
    compiled for this CPU), or "torch" where they are off (no library and no compiler, KVSERVE_NATIVE=0,
    a KVSERVE_ISA this CPU cannot run)."""
    if load("int4_matmul") is None:
        return "torch"
    chosen = _choices.get("int4_matmul")
    return chosen.isa if chosen is not None and chosen.isa != "native" else isa()


def build_flags(name: str, isa: str | None = None) -> list[str]:
    """Every compiler flag of ``<name>.c`` for the path ``isa`` (None: this CPU, -march=native)."""
    target = ISA_FLAGS[isa] if isa else ["-march=native"]
    return [*FLAGS, *target, *SOURCE_FLAGS.get(name, [])]


def source_key(name: str, flags: list[str]) -> str:
    """What a prebuilt ``<name>.so`` must have been built from: the source, every header of the
    directory and the flags (not the compiler: any build of the same text and flags will do)."""
    texts = [(SOURCE_DIR / f"{name}.c").read_text(), *(h.read_text() for h in sorted(SOURCE_DIR.glob("*.h")))]
    return hashlib.sha256("\0".join([*texts, " ".join(flags)]).encode()).hexdigest()[:16]


def _manifest(directory: Path) -> dict:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _prebuilt(name: str, paths: list[str]) -> tuple[Choice, ctypes.CDLL] | None:
    """The first of ``paths`` with a prebuilt ``<name>.so`` built from the sources beside it, loaded."""
    manifest = _manifest(PREBUILT_DIR)
    for path in paths:
        target = PREBUILT_DIR / path / f"{name}.so"
        if not target.exists():
            continue
        if manifest.get(f"{path}/{name}") != source_key(name, build_flags(name, path)):
            log.info("prebuilt %s for %s skipped: built from other sources or flags", name, path)
            continue
        try:
            library = ctypes.CDLL(str(target))
        except OSError as e:  # e.g. no libgomp.so.1 on this system
            log.warning("prebuilt %s for %s not loaded (%s)", name, path, e)
            continue
        why = (f"{path} asked for" if len(paths) == 1 and path != runnable_isas()[0] else
               "the fastest prebuilt path this CPU runs") + f" (the CPU runs {', '.join(runnable_isas())})"
        return Choice(name, path, "prebuilt", str(target), why), library
    return None


def prebuild(destination: Path, isas: list[str] | None = None, cc: str | None = None,
             kernels: list[str] | None = None) -> dict[str, str]:
    """Builds every kernel (or those named) for each path of ``isas`` (default: KVSERVE_PREBUILD_ISAS,
    comma-separated, else this machine type's ARCH_ISAS) into
    ``destination/<isa>/<name>.so`` and writes the manifest; a path the compiler cannot build is left
    out with a warning. Returns the manifest. Run by setup.py when a wheel is built."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("prebuilding the kernels needs a C compiler ($CC, cc, gcc or clang)")
    if isas is None:
        named = [p.strip() for p in os.environ.get("KVSERVE_PREBUILD_ISAS", "").split(",") if p.strip()]
        isas = named or list(ARCH_ISAS.get(platform.machine().lower(), ("portable",)))
    unknown = [p for p in isas if p not in ISA_FLAGS]
    if unknown:
        raise ValueError(f"no instruction-set path {', '.join(unknown)}: use {', '.join(ISA_FLAGS)}")
    names = kernels if kernels is not None else [s.stem for s in sorted(SOURCE_DIR.glob("*.c"))]
    jobs = [(path, name) for path in isas for name in names]

    def build_one(job: tuple[str, str]) -> tuple[str, str, str | None]:
        path, name = job
        flags = build_flags(name, path)
        try:
            _build(cc, flags, SOURCE_DIR / f"{name}.c", destination / path / f"{name}.so")
        except subprocess.CalledProcessError as e:
            return path, name, (e.stderr or "").strip()[-300:] or "failed"
        return path, name, None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # the compilers run apart
        results = list(pool.map(build_one, jobs))
    failed = {path: error for path, _, error in results if error is not None}
    for path, error in failed.items():  # a path is shipped whole or not at all
        log.warning("kernels for %s not prebuilt: %s", path, error)
        shutil.rmtree(destination / path, ignore_errors=True)
    manifest = {f"{path}/{name}": source_key(name, build_flags(name, path))
                for path, name, _ in results if path not in failed}
    destination.mkdir(parents=True, exist_ok=True)
    (destination / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _build(cc: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled ``<name>.c``, or None when native kernels are off or cannot be built. ``isa``: build
    for that path instead of KVSERVE_ISA's (tests and benchmarks compare the paths)."""
    if os.environ.get("KVSERVE_NATIVE", "1") == "0":
        return None
    chosen = isa or requested_isa()
    if chosen and chosen not in runnable_isas():
        log.warning("KVSERVE_ISA=%s: this CPU cannot run that path (it runs %s): native %s kernel off, "
                    "using the torch path", chosen, ", ".join(runnable_isas()), name)
        return None
    found = _prebuilt(name, [chosen] if chosen else runnable_isas())
    if found is not None:
        _choices[name] = found[0]
        return found[1]
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found and no prebuilt %s library fits: native kernel off, "
                    "using the torch path", name)
        return None
    source = SOURCE_DIR / f"{name}.c"
    flags = build_flags(name, chosen)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout
        # the sources and flags as a prebuilt library is keyed, and the compiler and CPU it was built by
        key = hashlib.sha256("\0".join([source_key(name, flags), version,
                                        _cpu_flags()]).encode()).hexdigest()[:16]
        target = cache_dir() / f"{name}-{key}.so"
        how = "cached" if target.exists() else "compiled"
        if not target.exists():
            try:
                _build(cc, flags, source, target)
            except subprocess.CalledProcessError:
                if "-fopenmp" not in flags:
                    raise
                # a compiler without OpenMP (Apple's clang): the same kernels on the calling thread
                _build(cc, [f for f in flags if f != "-fopenmp"], source, target)
                log.warning("%s has no OpenMP: native %s kernel built to run on one thread", cc, name)
        library = ctypes.CDLL(str(target))
        why = "KVSERVE_ISA" if chosen else "no prebuilt library fits: built for this CPU (-march=native)"
        _choices[name] = Choice(name, chosen or "native", how, str(target), f"{why}, with {cc}")
        return library
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("native %s kernel not built (%s): using the torch path", name, detail.strip()[-500:])
        return None


@cache
def function(source: str, name: str, argtypes: tuple | None = None, restype=None):
    """The function ``name`` of the compiled ``<source>.c`` with kernels.h's ctypes signature (abi.py),
    or None where ``load`` gives no library. A caller that still writes ``argtypes`` (and ``restype``)
    by hand gets TypeError where they disagree with the header."""
    if argtypes is not None:
        abi.check(name, argtypes, restype)
    lib = load(source)
    return None if lib is None else abi.bind(lib, name)


_threads: int | None = None  # set_num_threads's count, None: the default


def set_num_threads(count: int) -> None:
    """Threads every kernel call splits its work over from now on (``--threads``); torch's own count too
    where torch is loaded, so that its ops and ours share the same cores."""
    global _threads
    _threads = max(1, int(count))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(_threads)


def num_threads() -> int:
    """Threads a kernel call splits its work over: torch's count while torch is loaded (the kernels link
    the OpenMP runtime torch does, and tests that set torch's count expect ours to follow), else
    ``set_num_threads``'s, else every CPU this process may run on (OpenMP's default)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    if _threads is not None:
        return _threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

"""``kvserve doctor``: what this machine gives kvserve: the CPU's paths, the kernel library each kernel
loaded and why, the compiler, and the optional backends.

The first thing to ask when kvserve is slow on a machine: a kernel on the torch path, or compiled for
a lower path than the CPU runs, explains most of it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="which kernel library this CPU runs and why, and what is installed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def report() -> dict:
    from kvserve import __version__, native

    kernels = sorted(p.stem for p in native.SOURCE_DIR.glob("*.c"))
    loaded = {name: native.load(name) is not None for name in kernels}
    choices = native.choices()
    return {
        "kvserve": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": native.cpu_model(),
        "cpu_paths": native.runnable_isas(),
        "requested_path": native.requested_isa(),
        "kernel_path": native.kernel_path(),
        "compiler": native.compiler(),
        "prebuilt_paths": sorted(p.name for p in native.PREBUILT_DIR.glob("*") if p.is_dir()),
        "kernels": {
            name: ({"path": choices[name].isa, "how": choices[name].how, "why": choices[name].why,
                    "library": choices[name].path} if loaded[name] and name in choices else None)
            for name in kernels
        },
        "torch": importlib.util.find_spec("torch") is not None,
    }


def run(args: argparse.Namespace) -> int:
    info = report()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"kvserve {info['kvserve']} on Python {info['python']}, {info['machine']}: {info['cpu']}")
    print(f"paths this CPU runs: {', '.join(info['cpu_paths'])}"
          + (f" (KVSERVE_ISA asks for {info['requested_path']})" if info["requested_path"] else ""))
    print(f"prebuilt paths in this install: {', '.join(info['prebuilt_paths']) or 'none (source install)'}")
    print(f"C compiler: {info['compiler'] or 'none on PATH'}")
    print(f"kernels run on: {info['kernel_path']}")
    for name, choice in info["kernels"].items():
        line = f"{choice['path']}, {choice['how']}: {choice['why']}" if choice else "not loaded: torch path"
        print(f"  {name:16} {line}")
    print(f"torch: {'installed' if info['torch'] else 'not installed'}")
    return 0

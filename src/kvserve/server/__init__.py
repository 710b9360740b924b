"""HTTP front ends over the ``AsyncLLMEngine``: OpenAI- and Ollama-compatible APIs, health and metrics.

Both APIs map their requests onto one ``SamplingParams`` and read one ``RequestOutput`` stream; the
server never touches the engine's internals except to read its bookkeeping for metrics.
"""

from kvserve.server.server_config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str):
    if name == "build_app":  # lazily: the CLI parser imports this package; fastapi and torch are not free
        from kvserve.server.app import build_app

        return build_app
    raise AttributeError(name)

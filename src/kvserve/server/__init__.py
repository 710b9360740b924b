"""HTTP front ends over the ``AsyncLLMEngine``: the OpenAI (chat, completions, Responses, embeddings),
Ollama, Anthropic Messages and llama.cpp (``/infill``, ``/tokenize``) dialects, each a package of its own,
beside the web page, health, metrics and the replicas behind Ray Serve.

Every dialect maps its requests onto one ``SamplingParams`` through ``serving.Serving`` and reads one
``RequestOutput`` stream; what the routes show of the engine (metrics, the live KV pool) is read in
``engine_view`` and ``web.pool_view``, the two places that look inside it.
"""

from kvserve.server.server_config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str):
    if name == "build_app":  # lazily: the CLI parser imports this package; fastapi and torch are not free
        from kvserve.server.app import build_app

        return build_app
    raise AttributeError(name)

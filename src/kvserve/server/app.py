"""``build_app``: the FastAPI app over the models a server holds (``model_slots``), each its own
``AsyncLLMEngine``, plus the operational endpoints.

/v1/...        OpenAI (openai/chat_api)     /api/...      Ollama (ollama/api)
/v1/responses  OpenAI's Responses API (openai/responses_api)
/v1/messages   Anthropic (anthropic/api)
/tokenize, /detokenize, /infill   llama.cpp's server (llamacpp/api)
/v1/embeddings, /api/embed, /api/embeddings   an encoder's sentence embeddings (embeddings_api)
/v1/rerank     a cross-encoder's relevance of documents to a query (rerank_api)
/health        200 while every loaded engine runs    /metrics      Prometheus text format, every model
/v1/kvserve/cache   KV blocks: free, held, and each live request's block table (?model=: which model's)
/v1/kvserve/models  every model, loaded or not, and the last loads and unloads
/openapi.json  the OpenAPI spec (FastAPI), /docs its UI
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict

from kvserve import __version__
from kvserve.engine.async_engine import AsyncLLMEngine, EngineShutdownError
from kvserve.server import embeddings_api, rerank_api
from kvserve.server.anthropic import api as anthropic_api
from kvserve.server.api_errors import install_error_handlers
from kvserve.server.engine_view import EngineSnapshot, EngineView
from kvserve.server.llamacpp import api as llamacpp_api
from kvserve.server.metrics import ServerMetrics
from kvserve.server.middleware import (
    OPEN_PATHS,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    ErrorCountMiddleware,
    JSONBodyMiddleware,
)
from kvserve.server.model_card import ModelCard
from kvserve.server.model_slots import ModelEvent, ModelState, ServedModels
from kvserve.server.ollama import api as ollama_api
from kvserve.server.ollama import embed_api as ollama_embed_api
from kvserve.server.openai import chat_api, responses_api
from kvserve.server.openapi_docs import ok, openai_errors, openapi_document
from kvserve.server.server_config import ServerConfig
from kvserve.server.serving import Serving
from kvserve.server.web import page as web_page

ops = APIRouter(tags=["Operations"])


@ops.get("/", response_class=PlainTextResponse)
async def root() -> str:
    return "kvserve is running"  # Ollama answers "Ollama is running"; some clients probe it


class Health(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["ok", "error"]
    model: str | None = None  # the default model
    loaded: list[str] | None = None  # the models loaded now, when ok
    error: str | None = None  # when not


@ops.get(
    "/health",
    response_model=None,
    responses=ok(Health,
                 "Every loaded engine runs") | {503: {"model": Health, "description": "An engine stopped"}},
)
async def health(request: Request) -> JSONResponse:
    models: ServedModels = request.app.state.models
    for slot in models.loaded():
        dead = slot.serving.async_engine.dead_error
        if isinstance(dead, EngineShutdownError):
            return JSONResponse({"status": "error", "model": slot.name, "error": str(dead)}, 503)
        if dead is not None:
            return JSONResponse({"status": "error", "model": slot.name,
                                 "error": f"model '{slot.name}''s engine stopped after an internal error"},
                                 503)
    return JSONResponse({"status": "ok", "model": models.slots[0].name,
                         "loaded": [s.name for s in models.loaded()]})


@ops.get(
    "/metrics", response_class=PlainTextResponse, responses={200: {"description": "Prometheus text format"}}
)
async def metrics(request: Request) -> Response:
    body = await asyncio.to_thread(request.app.state.metrics.exposition)  # waits for the engine lock
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@ops.get(
    "/v1/kvserve/cache", response_model=None,
    responses=ok(EngineSnapshot, "The KV cache's block accounting") | openai_errors(404, 409),
)
async def cache(request: Request, model: str | None = Query(
        None,
        description="the loaded model whose pool to show (default: the first model, else the last used)")
) -> dict:
    """Exact block accounting, taken between engine steps: ``held_blocks`` is the union of the
    live requests' block tables, and every other block is free."""
    view: EngineView = request.app.state.models.shown(model).view
    snapshot = await asyncio.to_thread(view.snapshot)
    return snapshot.to_json()


class ModelsView(BaseModel):
    models: list[ModelState]  # every model the server holds, loaded or not
    events: list[ModelEvent]  # the last loads and unloads, oldest first


@ops.get("/v1/kvserve/models", response_model=None,
         responses=ok(ModelsView, "Every model, and the last loads"))
async def model_states(request: Request) -> dict:
    """Every chat model the server holds (loaded, loading or unloaded; planned size; when it unloads if
    idle) and the last load and unload events: what the web page and ``kvserve top`` list."""
    models: ServedModels = request.app.state.models
    return ModelsView(models=models.states(), events=models.recent()).model_dump()


def _publish_kv_events(async_engine: AsyncLLMEngine, publisher) -> None:
    with async_engine.lock:  # between steps
        async_engine.engine.publish_kv_events(publisher)


def build_app(
    async_engine: AsyncLLMEngine,
    config: ServerConfig,
    card: ModelCard | None = None,
    view: EngineView | None = None,
    encoder=None,
    reranker=None,
    models=None,
) -> FastAPI:
    """The app owns ``async_engine`` from now on: it shuts the engine down when the server stops.
    ``view`` replaces the engine's own for ``/metrics`` and ``/v1/kvserve/cache`` (replicas: their sum);
    ``encoder`` (``models.encoder.Encoder``) answers the embeddings routes, ``reranker`` (a cross-encoder's)
    the rerank routes; ``models(serving)`` makes the ``ServedModels`` from the engine's own model, the
    default (by default it alone, never unloaded)."""
    card = card or ModelCard.from_engine(async_engine.engine, config.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        publisher = None
        if config.kv_events:
            from kvserve.server.replicas.kv_events import KVEventPublisher

            publisher = KVEventPublisher(config.kv_events)
            first = app.state.models.slots[0]
            first.pinned = True  # a router follows this engine's blocks: it stays
            await asyncio.to_thread(_publish_kv_events, first.serving.async_engine, publisher)
        app.state.kv_events = publisher
        app.state.models.start()
        yield
        await app.state.models.stop()  # every engine: the first too
        for encoder_engine in (app.state.encoder, app.state.reranker):  # a decoder's engine
            if hasattr(encoder_engine, "close"):
                await asyncio.to_thread(encoder_engine.close)
        if publisher is not None:  # after the engine's last step, so its events go out too
            await asyncio.to_thread(publisher.close)

    app = FastAPI(
        title="kvserve",
        version=__version__,
        description="OpenAI- and Ollama-compatible streaming over the kvserve engine.",
        lifespan=lifespan,
        docs_url=None,  # served below from the package's own copy of Swagger UI: no CDN, works offline
        redoc_url=None,
    )
    _api_page(app)
    app.state.metrics = ServerMetrics(lambda: app.state.models.views())
    first = Serving(async_engine, card, app.state.metrics, config, view)
    app.state.models = models(first) if models is not None else ServedModels(first)
    # what the OpenAPI document's examples read, kept apart from the model (which may be unloaded)
    dimensions = [first.hidden_size] + [e.config.dimensions for e in (encoder, reranker) if e is not None]
    examples = {"token_id": first.vocab_size - 1, "n": config.max_n,
                "dimensions": max(dimensions, default=1)}, \
        first.features
    del first
    install_error_handlers(app)
    app.include_router(chat_api.router)
    app.include_router(responses_api.router)
    app.include_router(ollama_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(llamacpp_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(ollama_embed_api.router)
    app.include_router(rerank_api.router)
    app.state.reranker = reranker
    app.state.encoder = encoder
    # what /api/tags, /api/ps and /api/show say of them (they stay loaded for the server's life)
    app.state.encoder_cards = [ModelCard.from_encoder(e) for e in (encoder, reranker) if e is not None]
    app.include_router(web_page.router)  # before ops: its / serves browsers the page
    app.include_router(ops)
    app.add_middleware(JSONBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(ErrorCountMiddleware, record=app.state.metrics.record_error)  # outermost: sees all

    def openapi() -> dict:
        if app.openapi_schema is None:  # built on first use, as FastAPI's own
            app.openapi_schema = openapi_document(app, OPEN_PATHS if config.api_key else None, *examples)
        return app.openapi_schema

    app.openapi = openapi
    return app


def _api_page(app: FastAPI) -> None:
    """``/docs``: Swagger UI over ``/openapi.json``, its scripts and styles from the ``swagger-ui-bundle``
    package (FastAPI's default page loads them from a CDN, blank offline)."""
    from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount("/docs/assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvserve API",
                                   swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui.css",
                                   swagger_favicon_url="/docs/assets/favicon-32x32.png",
                                   oauth2_redirect_url="/docs/oauth2-redirect")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

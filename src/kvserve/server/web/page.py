"""The built-in web page: chat over our OpenAI API and a live picture of the KV pool.

GET /                        the page to a browser (Accept: text/html); "kvserve is running" to others,
                             as before, for clients that probe the root the way they probe Ollama's
GET /v1/kvserve/cache/stream the pool a few times a second as server-sent events (``PoolFrame``s)

The page is one HTML document with its script and style inlined (``web/``), so it loads without the API
key (``/`` is open, as ``/health`` is) and nothing else needs to be fetched; everything it then asks
the server for goes through ``fetch`` with ``Authorization: Bearer``, which EventSource cannot send.
Its Content-Security-Policy allows exactly that script and style and connections back to this server.
"""

from __future__ import annotations

import base64
import hashlib
import weakref
from functools import cache
from importlib import resources

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from kvserve.server.api_errors import APIError
from kvserve.server.openapi_docs import JSON, SSE, openai_errors, streamed
from kvserve.server.streaming import EngineStreamingResponse, sse_response
from kvserve.server.web.pool_stream import PoolStream
from kvserve.server.web.pool_view import PoolFrame, PoolView

router = APIRouter(tags=["kvserve"])

SCRIPTS = ("api.js", "pool.js", "chat.js")  # one script, in this order

STREAM_ITEM = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "contentMediaType": JSON,
                            "contentSchema": streamed(PoolFrame)}},
}


@cache
def page() -> tuple[str, str]:
    """(the HTML with its script and style inlined, its Content-Security-Policy)."""
    web = resources.files("kvserve.server.web")
    script = "\n".join((web / name).read_text(encoding="utf-8") for name in SCRIPTS)
    style = (web / "app.css").read_text(encoding="utf-8")
    html = (web / "index.html").read_text(encoding="utf-8")
    html = html.replace("/*STYLE*/", style).replace("/*SCRIPT*/", script)

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    policy = (
        f"default-src 'none'; script-src {digest(script)}; style-src {digest(style)}; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html, policy


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: Claude Code's probe
async def root(request: Request) -> Response:
    if "text/html" not in request.headers.get("accept", ""):
        return PlainTextResponse("kvserve is running")  # Ollama answers "Ollama is running"; clients probe it
    html, policy = page()
    headers = {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }
    return HTMLResponse(html, headers=headers)


def pool_stream(request: Request, model: str | None) -> PoolStream:
    """The stream of a loaded model's pool, made on first use; it goes with the model (weakly held: an
    unloaded model's engine stops, which ends its stream)."""
    state = request.app.state
    serving = state.models.shown(model)
    streams = getattr(state, "pool_streams", None)
    if streams is None:
        streams = state.pool_streams = weakref.WeakKeyDictionary()
    stream = streams.get(serving)
    if stream is None:
        models = state.models
        stream = streams[serving] = PoolStream(PoolView(serving.async_engine, serving.card.name),
                                               lambda: (models.states(), models.recent()))
    return stream


@router.get(
    "/v1/kvserve/cache/stream",
    status_code=200,
    response_class=EngineStreamingResponse,  # no media type of its own: the 200 documents only the stream
    responses={
        200: {
            "description": "PoolFrames as server-sent events, a few a second",
            "content": {SSE: {"itemSchema": STREAM_ITEM}},
        }
    }
    | openai_errors(400, 404, 409, 501, 503),
)
async def cache_stream(
    request: Request,
    max_events: int | None = Query(
        None, ge=1, description="end the stream after this many frames (default: never)"
    ),
    model: str | None = Query(
        None, description="the loaded model whose pool to show (default: the first model, else the last used)"
    ),
):
    """A loaded model's KV pool live: each event one ``PoolFrame`` (every block's state as one character,
    each live request's blocks and context, counters for rates, and every model the server holds with the
    last loads and unloads). Frames are taken between engine steps; every subscriber gets the same frames,
    so more pages cost the engine nothing more. The stream ends when the engine stops (the model unloads)."""
    stream = pool_stream(request, model)
    engine = stream.view.async_engine
    if getattr(engine, "serves_replicas", False):
        raise APIError(501,
                       "the live pool shows one engine's pool: behind --replicas each replica has its own "
                            "(GET /v1/kvserve/replicas says which served what)", code="not_available")
    if engine.dead_error is not None:
        raise APIError(503, "the engine has stopped: the pool no longer changes", code="engine_dead")

    async def events():
        async for frame in stream.frames(max_events):
            yield b"data: " + frame + b"\n\n"

    return sse_response(events())

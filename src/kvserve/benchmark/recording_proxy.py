"""A recording proxy between a client (a coding agent) and a server: every request is forwarded as it came,
streamed answers stream through, and each exchange is kept as one record, for ``bench/agent_session.py``
to replay a session in order and for ``tests/agents`` to see every request an agent sent and every status it
got back.

    .venv/bin/python -m kvserve.benchmark.recording_proxy --upstream http://127.0.0.1:8000 --port 8100 \\
        --out session.jsonl

A record: {"t": seconds since the proxy started, "method", "path", "query", "headers" (those that shape an
answer: content-type, accept, anthropic-version, anthropic-beta), "body" (the JSON body, or null), "status",
"response_bytes", "seconds" (until the answer's last byte), "response" (the answer's text when it is not a
success, or when ``keep_responses``)}.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

KEPT_HEADERS = ("content-type", "accept", "anthropic-version", "anthropic-beta")
HOP_HEADERS = ("content-length", "transfer-encoding", "content-encoding", "connection")
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]


@dataclass
class Recorder:
    """The records so far, also appended to ``out`` (one JSON line each) when given."""

    out: Path | None = None
    keep_responses: bool = False
    records: list[dict] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: dict) -> None:
        with self.lock:
            self.records.append(record)
            if self.out is not None:
                with self.out.open("a") as f:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")


def proxy_app(upstream: str, recorder: Recorder) -> Starlette:
    """The proxy as an ASGI app forwarding to ``upstream``."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None))

    async def forward(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        record = {"t": round(time.monotonic() - recorder.start, 3), "method": request.method,
                  "path": request.url.path, "query": request.url.query, "body": body,
                  "headers": {k: v for k, v in request.headers.items() if k.lower() in KEPT_HEADERS}}
        began = time.monotonic()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        sent = client.build_request(request.method, request.url.path, params=request.query_params,
                                    headers=headers, content=raw)
        answer = await client.send(sent, stream=True)
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_HEADERS}
        keep = recorder.keep_responses or answer.status_code >= 400

        async def relay():
            size, text = 0, bytearray()
            try:
                async for chunk in answer.aiter_raw():
                    size += len(chunk)
                    if keep:
                        text += chunk
                    yield chunk
            finally:
                await answer.aclose()
                recorder.add({**record, "status": answer.status_code, "response_bytes": size,
                              "seconds": round(time.monotonic() - began, 3),
                              **({"response": text.decode(errors="replace")} if keep else {})})

        return StreamingResponse(relay(), status_code=answer.status_code, headers=kept)

    return Starlette(routes=[Route("/{path:path}", forward, methods=METHODS)])


class RecordingProxy:
    """The proxy on a loopback port of its own, served from a background thread: ``url`` while started."""

    def __init__(self, upstream: str, recorder: Recorder | None = None) -> None:
        self.recorder = recorder or Recorder()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(proxy_app(upstream, self.recorder), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="recording-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    app = proxy_app(args.upstream, Recorder(args.out))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

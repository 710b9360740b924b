"""Graceful shutdown: a stopping server tells every open stream why it ends."""

from __future__ import annotations

from collections.abc import Callable

import uvicorn

SHUTDOWN_REASON = "the server is shutting down; retry once it is back"


class EndingStreamsServer(uvicorn.Server):
    """On SIGTERM/SIGINT, ends every open stream at once with a final error event (SSE: an error
    object and ``[DONE]``; NDJSON: an ``error`` line) and refuses new requests with 503, so the
    connections close within the graceful timeout instead of being cut mid-answer."""

    def __init__(self, config: uvicorn.Config, end_streams: Callable[[str], None]) -> None:
        super().__init__(config)
        self.end_streams = end_streams  # every loaded engine's (``ServedModels.end_streams``)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.end_streams(SHUTDOWN_REASON)

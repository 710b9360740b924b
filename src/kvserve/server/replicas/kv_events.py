"""``--kv-events ENDPOINT``: the prefix cache's events (``kv.events``) on a ZeroMQ socket, in the
format vLLM publishes, so llm-d's KV indexer and Dynamo's KV router can route to this server.

Each engine step's events are one message of three frames:

    topic      b"" (vLLM's default)
    seq        8 bytes, big-endian: 0, 1, 2 ... one per message (a gap means messages were lost)
    payload    msgpack [ts, [event, ...], data_parallel_rank]    (vLLM's KVEventBatch, array_like)

    event      ["BlockStored", [hash, ...], parent_hash | nil, [token id, ...], block_size, nil, medium, nil]
               ["BlockRemoved", [hash, ...], medium]
               ["AllBlocksCleared"]

Hashes are unsigned 64-bit integers (``kv.events.wire_hash``). The socket lives on its own thread,
fed by a queue: a step only appends to the queue and never waits for the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from kvserve.kv.events import KVEvent

log = logging.getLogger(__name__)

MAX_QUEUED_STEPS = 100_000  # steps' events waiting for the socket; past it they are dropped (and counted)


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """One message's payload, the bytes vLLM's msgspec encoder writes for a ``KVEventBatch``."""
    import msgpack

    return msgpack.packb([ts, [e.to_wire() for e in events], data_parallel_rank], use_bin_type=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule, so its endpoints mean the same here: a wildcard host (``tcp://*:5557``) or an
    ipc/inproc address binds (subscribers connect to us: Dynamo's relay); any other host connects
    to a subscriber that binds there (llm-d's indexer)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_endpoint(endpoint: str) -> str:
    """``endpoint``, once it looks like a ZeroMQ address and the libraries are there."""
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        raise ValueError("--kv-events needs pyzmq and msgpack: pip install 'kvserve[events]'") from None
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")) or (
        endpoint.startswith("tcp://") and not endpoint.rpartition(":")[2].isdigit()
    ):
        raise ValueError(
            f"--kv-events wants a ZeroMQ address such as tcp://*:5557 or tcp://HOST:PORT, got {endpoint!r}")
    return endpoint


class KVEventPublisher:
    """Call it with a step's events (the engine's sink); ``close`` sends what is queued and stops.

    The socket is an XPUB, which subscribers see as a PUB; it also tells us when a subscription
    arrives (``subscribed``), since a PUB drops whatever it sends before that."""

    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int = 0) -> None:
        self.endpoint = check_endpoint(endpoint)
        import zmq

        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.subscribed = threading.Event()
        self.num_published = 0  # messages sent; the next one's seq
        self.num_dropped = 0  # steps' events dropped because the queue was full
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(MAX_QUEUED_STEPS)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        try:
            (self._socket.bind if binds(endpoint) else self._socket.connect)(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            self._ctx.term()
            raise ValueError(f"cannot publish KV events on {endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def __call__(self, events: list[KVEvent]) -> None:
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:  # the socket thread is stuck: never stall a step for it
            self.num_dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close the socket."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._socket.close(linger=int(timeout * 1000))
        self._ctx.term()

    def _run(self) -> None:
        while True:
            self._read_subscriptions()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.data_parallel_rank)
                self._socket.send_multipart([self.topic, self.num_published.to_bytes(8, "big"), payload])
                self.num_published += 1
            except Exception:  # a bad batch must not end the thread (and every later one)
                log.exception("could not publish KV events")

    def _read_subscriptions(self) -> None:
        while self._socket.poll(0):
            message = self._socket.recv()
            if message[:1] == b"\x01":  # XPUB: 1 + topic subscribes, 0 + topic unsubscribes
                self.subscribed.set()

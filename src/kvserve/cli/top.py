"""``kvserve top [URL]``: a running server's KV pool live in the terminal, the numbers of its web page.

Reads ``/v1/kvserve/cache/stream`` (four frames a second) and redraws: every model the server holds (loaded,
loading or not, and its last loads and unloads), then one loaded model's totals, every block of its pool as
one coloured cell (free, cached, in use, shared by n), its live requests, and tokens generated per second.
When that model unloads, top follows whichever the server shows next.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from collections.abc import Iterator

CELL = {".": ("·", "grey50"), "c": ("■", "blue")}
USED, SHARED = "green", "dark_orange"
SPARKS = "▁▂▃▄▅▆▇█"
RATE_WINDOW_S = 60
MAX_ROWS = 16  # of block cells; a larger pool draws several blocks per cell, the busiest


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="watch a running server's KV pool live: blocks, requests, tok/s")
    p.add_argument(
        "url", nargs="?", default="http://127.0.0.1:8000", help="the server (http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY"),
        help="the server's --api-key (default: $KVSERVE_API_KEY)",
    )
    p.add_argument("--model", default=None,
                   help="the loaded model whose pool to show (default: the server's first, "
                   "else the last used)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(handler=run)


class NotLoaded(ValueError):
    """The server runs, but not the model asked for (or none): it may load later."""


class ServerGone(ValueError):
    """The server cannot be reached, or is shutting down."""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def frames(url: str, api_key: str | None, max_events: int | None = None,
           model: str | None = None) -> Iterator[dict]:
    import httpx

    headers = _headers(api_key)
    params = {"max_events": max_events} if max_events else {}
    if model:
        params["model"] = model
    try:
        with httpx.stream(
            "GET",
            url.rstrip("/") + "/v1/kvserve/cache/stream",
            headers=headers,
            params=params,
            timeout=httpx.Timeout(10, read=None),
        ) as r:
            if r.status_code == 401:
                raise ValueError(f"{url} needs its API key: give --api-key or set $KVSERVE_API_KEY")
            if r.status_code == 409:
                raise NotLoaded(json.loads(r.read())["error"]["message"])
            body = r.read().decode(errors="replace") if r.status_code != 200 else ""
            if r.status_code == 503 and "shutting_down" in body:
                raise ServerGone(f"{url} is shutting down")
            if r.status_code != 200:
                raise ValueError(f"{url} answered {r.status_code}: {body[:200]}")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])
    except httpx.TransportError as e:
        raise ServerGone(f"cannot reach {url} ({e}): is `kvserve serve` running there?") from None


def _cell(codes: str) -> tuple[str, str]:
    """(character, style) of a cell drawing ``codes``: its busiest block."""
    used = [10 if c == "+" else int(c) for c in codes if c not in CELL]
    if not used:
        return CELL["c" if "c" in codes else "."]
    n = max(used)
    return ("█", USED) if n == 1 else (str(n) if n < 10 else "+", f"black on {SHARED}")


def pool_grid(frame: dict, width: int):
    from rich.text import Text

    codes = frame["blocks"]
    per_cell = max(1, -(-len(codes) // (width * MAX_ROWS)))
    grid = Text()
    for i, start in enumerate(range(0, len(codes), per_cell)):
        if i and i % width == 0:
            grid.append("\n")
        grid.append(*_cell(codes[start : start + per_cell]))
    return grid


def sparkline(rates: list[float]) -> str:
    top = max(rates, default=0) or 1
    return "".join(SPARKS[min(len(SPARKS) - 1, int(r / top * len(SPARKS)))] for r in rates)


STATE = {"loaded": ("●", "green"), "loading": ("◐", "yellow"), "unloaded": ("○", "grey50")}


def models_line(frame: dict):
    """Every model the server holds, the one shown in bold, and its last load or unload events."""
    from rich.text import Text

    line = Text("models ")
    for m in frame.get("models", []):
        mark, style = STATE.get(m["state"], ("?", ""))
        line.append(f"{mark} ", style)
        line.append(m["name"], "bold" if m["name"] == frame["model"] else "")
        size = f" {m['planned_bytes'] / 2**20:.0f} MiB" if m["planned_bytes"] else ""
        expiry = f", unloads in {max(0, m['expires_at'] - frame['time']):.0f} s" if m["expires_at"] else ""
        line.append(f" ({m['state']}{size}{expiry})  ", "dim")
    for e in frame.get("model_events", [])[-3:]:
        line.append(f"\n  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['model']} {e['event']} "
                    f"{e['detail']}", "dim")
    return line


def render(frame: dict, rates: list[float], width: int = 80):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    mib = 1 << 20
    queries = frame["prefix_cache_queries"]
    hits = f"{100 * frame['prefix_cache_hits'] / queries:.1f}%" if queries else "-"
    room = frame["num_free_blocks"] * frame["block_size"] + sum(
        len(r["blocks"]) * frame["block_size"] - r["num_tokens"]
        for r in frame["requests"]
        if r["status"] == "running"
    )
    kv = (
        frame["cache_type_k"]
        if frame["cache_type_k"] == frame["cache_type_v"]
        else (f"{frame['cache_type_k']}/{frame['cache_type_v']}")
    )
    rate = f"{rates[-1]:.0f}" if rates else "-"
    head = Text.assemble(
        (f"{frame['model']}", "bold"),
        f"  {frame['num_running']} running, {frame['num_waiting']} waiting  |  KV {kv}, "
        f"{frame['kv_bytes_per_token'] / 1024:.1f} KiB/token, pool {frame['kv_pool_bytes'] / mib:.1f} MiB\n",
        f"blocks {frame['num_used_blocks']}/{frame['num_blocks']} in use ({100 * frame['usage']:.0f}%), "
        f"{frame['num_shared_blocks']} shared, {frame['num_cached_free_blocks']} cached  |  prefix hits "
        f"{hits}\n",
        f"room before a preemption {room} tokens  |  preemptions {frame['num_preemptions']}\n",
        f"{rate} tok/s ",
        (sparkline(rates[-(width - 12) :]), "green"),
    )
    table = Table(box=None, pad_edge=False, header_style="dim")
    for column in ("request", "state", "context", "blocks", "KV MiB"):
        table.add_column(column, justify="right" if column in ("blocks", "KV MiB") else "left")
    for r in frame["requests"]:
        table.add_row(
            r["id"],
            r["status"],
            f"{r['num_tokens']} / {frame['max_model_len']}",
            str(len(r["blocks"])),
            f"{r['kv_bytes'] / mib:.2f}",
        )
    legend = Text.assemble(
        ("· free  ", "grey50"),
        ("■ cached  ", "blue"),
        ("█ in use  ", USED),
        ("2 ", f"black on {SHARED}"),
        (" shared by n", SHARED),
    )
    return Group(models_line(frame), head, legend, pool_grid(frame, width), table)


class Rates:
    """Tokens generated per second over the second before each frame, for the last minute."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()
        self.rates: deque[float] = deque(maxlen=RATE_WINDOW_S * 4)

    def add(self, frame: dict) -> list[float]:
        now = frame["time"]
        self.samples.append((now, frame["num_generated_tokens"]))
        while len(self.samples) > 2 and self.samples[1][0] <= now - 1:
            self.samples.popleft()
        (t0, g0), (t1, g1) = self.samples[0], self.samples[-1]
        if t1 > t0:
            self.rates.append((g1 - g0) / (t1 - t0))
        return list(self.rates)


def waiting(args: argparse.Namespace, why: str):
    """What top shows while the model it would show is not loaded: every model, and why it waits."""
    import httpx
    from rich.console import Group

    try:
        r = httpx.get(args.url.rstrip("/") + "/v1/kvserve/models", headers=_headers(args.api_key), timeout=10)
        state = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        state = None
    if not isinstance(state, dict) or "models" not in state:
        return f"{why}; waiting"
    frame = {"model": args.model or "", "time": time.time(), "models": state["models"],
             "model_events": state["events"]}
    return Group(models_line(frame), f"{why}; waiting")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    width = max(20, console.width - 2)
    rates = Rates()
    if args.once:
        for frame in frames(args.url, args.api_key, max_events=1, model=args.model):
            console.print(render(frame, rates.add(frame), width))
        return 0
    try:
        with Live(console=console, auto_refresh=False, screen=console.is_terminal) as live:
            while True:  # a stream ends when its model unloads: then the one the server shows next
                try:
                    for frame in frames(args.url, args.api_key, model=args.model):
                        live.update(render(frame, rates.add(frame), width), refresh=True)
                except NotLoaded as e:
                    live.update(waiting(args, str(e)), refresh=True)
                time.sleep(1)
                rates = Rates()
    except KeyboardInterrupt:
        return 0
    except ServerGone:  # gone, or going (a graceful stop)
        pass
    console.print("the server stopped", style="dim")
    return 0

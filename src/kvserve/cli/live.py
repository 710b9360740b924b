"""A live view for ``kvserve run`` on a terminal: the answer as it streams, and under it a status line
(TTFT, tok/s, context used / num_ctx, KV bytes, cached prefix tokens) refreshed with every token."""

from __future__ import annotations

import time
from typing import Self

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from kvserve.engine.outputs import RequestOutput


def status_text(engine, out: RequestOutput) -> Text:
    m = out.metrics
    used = m.num_prompt_tokens + m.num_generation_tokens
    elapsed = time.perf_counter() - m.first_token_time if m.first_token_time else 0.0
    rate = (m.num_generation_tokens - 1) / elapsed if elapsed > 0 and m.num_generation_tokens > 1 else 0.0
    ttft = f"{m.ttft * 1000:.0f} ms" if m.ttft is not None else "-"
    return Text(
        f"TTFT {ttft} | {rate:.1f} tok/s | context {used}/{engine.max_model_len} | "
        f"KV {used * engine.kv_bytes_per_token / 2**20:.2f} MiB | cached prefix {m.num_cached_tokens} tok",
        style="dim",
    )


class LiveAnswer:
    """Context manager: ``update(output)`` after each step; leaves the plain answer on screen at exit."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.console = Console()
        self.text = ""
        self.live = Live(console=self.console, transient=True, auto_refresh=False, vertical_overflow="visible")

    def __enter__(self) -> Self:
        self.live.__enter__()
        return self

    def update(self, out: RequestOutput) -> None:
        self.text += out.delta_text
        self.live.update(Group(Text(self.text), status_text(self.engine, out)), refresh=True)

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)
        self.console.file.write(self.text)
        self.console.file.flush()

"""One answer of ``kvserve run`` and its chat as it streams: on a terminal a live view (the answer, and under
it a status line of TTFT, tok/s, context used / num_ctx, KV bytes, cached prefix tokens refreshed with every
token), plainly otherwise; then its record (``--json``) and its stats line."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Self

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams


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
        self.live = Live(console=self.console, transient=True, auto_refresh=False,
                         vertical_overflow="visible")

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


def generate_streaming(engine, prompt_ids: list[int], params: SamplingParams,
                       echo: bool = True) -> RequestOutput:
    """Run one request to the end, echoing its text: with a live status line on a terminal, plainly
    otherwise. Ctrl-C stops the answer (the request is aborted) rather than the program."""
    request = engine.add_request(prompt_ids, params)
    final = None
    live = LiveAnswer(engine) if echo and sys.stdout.isatty() else None
    try:
        with live or contextlib.nullcontext():
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if live is not None:
                        live.update(output)
                    elif echo and output.delta_text:
                        sys.stdout.write(output.delta_text)
                        sys.stdout.flush()
                    if output.finished:
                        final = output
    except KeyboardInterrupt:
        final = engine.abort_request(request.request_id)
        if final is None:
            raise
    return final


def result_record(engine, out: RequestOutput) -> dict:
    m = out.metrics
    return {
        "text": out.text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": m.num_prompt_tokens,
        "cached_prompt_tokens": m.num_cached_tokens,
        "completion_tokens": m.num_generation_tokens,
        "ttft_ms": round(m.ttft * 1000, 2) if m.ttft is not None else None,
        "prefill_tok_s": round(m.prefill_tok_s, 2) if m.prefill_tok_s else None,
        "decode_tok_s": round(m.decode_tok_s, 2) if m.decode_tok_s else None,
        "itl_ms_mean": round(1000 * sum(m.itls) / len(m.itls), 2) if m.itls else None,
        "kv_bytes": (m.num_prompt_tokens + m.num_generation_tokens) * engine.kv_bytes_per_token,
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        "cache_type_k": engine.config.cache.cache_type_k,
        "cache_type_v": engine.config.cache.cache_type_v_resolved,
        "kv_pool_bytes": engine.kv_pool_bytes,
        "draft_tokens": m.num_draft_tokens,
        "accepted_draft_tokens": m.num_accepted_tokens,
        "weights": engine.loaded.model.weight_format,
        "weights_why": engine.loaded.weights_why,
        "kernels": engine.kernels,
        "kernel_library": _kernel_library(),
    }


def _kernel_library() -> str | None:
    """How the int4 matmul's library came to be ("prebuilt", "compiled", "cached"): ``kvserve doctor``
    says it for every kernel."""
    from kvserve import native

    choice = native.choices().get("int4_matmul")
    return None if choice is None else f"{choice.how} {choice.isa}"


def stats_line(engine, out: RequestOutput) -> str:
    r = result_record(engine, out)

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    return (
        f"prompt {r['prompt_tokens']} tok ({r['cached_prompt_tokens']} cached) | "
        f"TTFT {fmt(r['ttft_ms'], '.0f')} ms | prefill {fmt(r['prefill_tok_s'], '.1f')} tok/s | "
        f"completion {r['completion_tokens']} tok | decode {fmt(r['decode_tok_s'], '.1f')} tok/s | "
        f"KV {r['kv_bytes'] / 2**20:.2f} MiB in use of {r['kv_pool_bytes'] / 2**20:.0f} MiB"
    )

"""llama.cpp's KV cache types measured by its own ``llama-perplexity --kl-divergence``, on the same GGUF
file and the same tokens as ours (``kvserve eval --compare llama.cpp``).

llama.cpp's method decides the shared ground. ``llama-perplexity`` tokenizes the text itself, cuts it into
chunks of ``n_ctx`` tokens (the first of each replaced by BOS where the model adds one), evaluates each
from an empty cache and scores only the second half of every chunk (positions ``n_ctx/2 .. n_ctx-2``, so
every scored token has at least half a context behind it). Its reference run (``--kl-divergence-base``,
here with an f32 cache) writes the tokens into the logits file, so we read them back from there and score
our types on exactly those tokens and positions. What cannot be shared: each engine's reference is its own
forward with an f32 cache, and llama.cpp stores the reference log-probabilities as 16-bit codes (a floor
of ~1e-5 under its KLD).
"""

from __future__ import annotations

import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import KVServeError
from kvserve.quality.evaluate import EvalRow
from kvserve.quality.text import bos_prefix

LOGITS_MAGIC = b"_logits_"

# Bits per element of the ggml types llama.cpp's KV cache takes, block scales included.
GGML_KV_BITS = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0,
                "q4_0": 4.5, "iq4_nl": 4.5}


class PeerToolError(KVServeError):
    """llama-perplexity failed or printed no summary: its last lines say why."""


@dataclass(slots=True)
class LlamaQuality:
    """One llama.cpp K/V pair against its f32-cache reference, as llama-perplexity reports it."""

    kld: float  # "Mean KLD"
    top1_agreement: float  # "Same top p", percent
    ppl: float  # "Mean PPL(Q)"
    base_ppl: float  # "Mean PPL(base)"


def read_logits_tokens(path: str | Path) -> tuple[int, list[list[int]]]:
    """(n_ctx, each chunk's token ids) from the head of a llama-perplexity logits file: the magic, u32
    n_ctx, i32 n_vocab, i32 n_chunk, then n_ctx * n_chunk i32 tokens (the log-probabilities follow)."""
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:8] != LOGITS_MAGIC:
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        n_ctx, _, n_chunk = struct.unpack("<Iii", head[8:])
        if n_ctx < 2 or n_chunk < 1:
            raise ValueError(f"{path}: bad header (n_ctx {n_ctx}, n_chunk {n_chunk})")
        body = f.read(4 * n_ctx * n_chunk)
    if len(body) < 4 * n_ctx * n_chunk:
        raise ValueError(f"{path}: truncated token list")
    tokens = list(struct.unpack(f"<{n_ctx * n_chunk}i", body))
    return n_ctx, [tokens[i * n_ctx : (i + 1) * n_ctx] for i in range(n_chunk)]


_STATS = {
    "kld": r"Mean\s+KLD:\s*([-\d.eE+]+)",
    "top1_agreement": r"Same top p:\s*([-\d.eE+]+)",
    "ppl": r"Mean PPL\(Q\)\s*:\s*([-\d.eE+]+)",
    "base_ppl": r"Mean PPL\(base\)\s*:\s*([-\d.eE+]+)",
}


def parse_kld_output(text: str) -> LlamaQuality:
    """The summary llama-perplexity prints after a ``--kl-divergence`` run."""
    values = {}
    for name, pattern in _STATS.items():
        found = re.search(pattern, text)
        if found is None:
            raise PeerToolError(f"llama-perplexity printed no {name!r} statistic")
        values[name] = float(found.group(1))
    return LlamaQuality(**values)


class LlamaPerplexity:
    """Runs ``llama-perplexity`` from ``folder`` on one GGUF file, flash attention on (llama.cpp needs it
    for a quantized V cache), one sequence per batch."""

    def __init__(self, folder: Path, model_path: str | Path, threads: int) -> None:
        self.tool = Path(folder) / "llama-perplexity"
        self.model_path, self.threads = str(model_path), threads

    def _run(self, *args: str) -> str:
        try:
            out = subprocess.run([str(self.tool), "-m", self.model_path, "-t", str(self.threads), "-fa", "on",
                                  *args], capture_output=True, text=True, timeout=7200, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerToolError(f"llama-perplexity did not run: {e}") from e
        if out.returncode != 0:
            tail = [line for line in (out.stderr + out.stdout).strip().splitlines() if line.strip()][-3:]
            raise PeerToolError("llama-perplexity failed: " + " | ".join(tail))
        return out.stdout + out.stderr

    def reference_tokens(self, tokenizer, text: str, ctx: int, windows: int, work: Path) -> list[int]:
        """Runs the f32-cache reference of ``windows`` chunks of ``ctx`` tokens of the text (its tokens
        and log-probabilities into ``work``/reference.kld) and returns those tokens for our rows, the first
        of each window made BOS where the model adds one, as llama-perplexity does."""
        (work / "text.txt").write_text(text, encoding="utf-8")
        self._run("-f", str(work / "text.txt"), "-c", str(ctx), "-b", str(ctx), "--chunks", str(windows),
                  "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(work / "reference.kld"))
        n_ctx, chunks = read_logits_tokens(work / "reference.kld")
        if n_ctx != ctx or len(chunks) != windows:
            raise ValueError(f"llama-perplexity wrote {len(chunks)} x {n_ctx} tokens, not {windows} x {ctx}: "
                             "the text is too short (needs 2 x --ctx, --ctx x --windows tokens)")
        bos = bos_prefix(tokenizer)
        return [t for chunk in chunks for t in (*bos, *chunk[len(bos):])]

    def rows(self, pairs: list[tuple[str, str]], work: Path, ctx: int, on_row=None) -> list[EvalRow]:
        """One row per K/V pair llama.cpp has, against the reference in ``work``."""
        rows = []
        for k, v in pairs:
            if k not in GGML_KV_BITS or v not in GGML_KV_BITS:
                continue
            q = self.measure(k, v, work / "reference.kld", ctx)
            rows.append(EvalRow(k, v, (GGML_KV_BITS[k] + GGML_KV_BITS[v]) / 2, q.kld, q.top1_agreement, q.ppl,
                                q.ppl - q.base_ppl, None, engine="llama.cpp"))
            if on_row:
                on_row(rows[-1])
        return rows

    def measure(self, cache_type_k: str, cache_type_v: str, logits_file: str | Path,
                ctx: int) -> LlamaQuality:
        return parse_kld_output(self._run(
            "-c", str(ctx), "-b", str(ctx), "-ctk", cache_type_k, "-ctv", cache_type_v,
            "--kl-divergence", "--kl-divergence-base", str(logits_file)))

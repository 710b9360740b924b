"""Memory arithmetic: weights + KV cache + activations + runtime overhead, at each context length,
and the largest context that fits a memory budget. Plain integers; no torch.

The KV cache is the paged pool as the engine sizes it (``kv.pool_sizing``, the engine's own
arithmetic): ceil(ctx / block_size) blocks per sequence in every layer, except that a model with both
sliding-window and global layers (Gemma 2/3) keeps its sliding layers in a pool of their own sized for
their windows (``kv.groups.window_pool_blocks``), unless --no-window-kv.

Two totals, which differ only in the weights:

    total (plan)    weights as stored + the pool
    total (engine)  weights as the engine holds them (--weights: auto = q4 for a GGUF) + a chunk of rows of
    the
                    file mapped while loading + the pool

Both add the same activations and runtime overhead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.config import ModelConfig
from kvserve.kv.cache_types import keys_rotated, kv_bytes_per_token, kv_bytes_per_token_per_layer, kv_type
from kvserve.kv.disk_tier import capacity as disk_capacity
from kvserve.kv.pool_sizing import PoolSize
from kvserve.kv.pool_sizing import context_pool as engine_pool  # the engine's own arithmetic: no drift
from kvserve.kv.pool_sizing import context_pool_bytes as planned_kv_pool_bytes  # noqa: F401 (kvserve.plan's name)
from kvserve.models.layouts import ROW_CHUNK
from kvserve.plan.model_spec import ModelSpec, held_bytes
from kvserve.pretokenizers import PRE_TOKENIZERS

MiB, GiB = 1 << 20, 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUERY_TILE = 1024  # queries per attention tile, as in kvserve.attention.ops.QUERY_TILE
# the native kernels' tiles (native/prefill_attention.h, native/decode_attention.h)
NATIVE_QUERY_TILE, NATIVE_KEY_TILE, NATIVE_PARTITION = 32, 64, 256
ATTENTION_KERNELS = ("auto", "native", "torch")
# Resident memory of the Python process before any weight or cache: VmRSS after
# `python -c "import torch, kvserve"` measured 218.6 MiB (torch 2.13 CPU build, Python 3.11);
# re-measure with measure_runtime_overhead(). A CUDA build adds its context on top.
RUNTIME_OVERHEAD_BYTES = 220 * MiB
# The tokenizer's tables in Python per vocabulary entry: Tokenizer.from_gguf measured 29 MiB for SmolLM2's
# 49,152 tokens and 129 MiB for Gemma 3's 262,144 (619 and 516 bytes a token) through the `tokenizers`
# library. A SentencePiece vocabulary ("llama" in GGUF) has the kernel's table instead (spm.py): the header's
# pieces kept as bytes plus the table, 42 MiB for Gemma 3's (168 bytes a token). A byte-level BPE one ("gpt2")
# whose splits the kernel writes out has its tables (bpe.py): tokens and merges kept as bytes plus three hash
# tables, 38 MiB for Qwen2.5's 151,936 tokens (265 bytes a token) and 10 MiB for SmolLM2's (218).
TOKENIZER_BYTES_PER_TOKEN = 560
SPM_TOKENIZER_BYTES_PER_TOKEN = 170
BPE_TOKENIZER_BYTES_PER_TOKEN = 270


def tokenizer_bytes_per_token(spec: ModelSpec) -> int:
    if spec.tokenizer_model == "llama":
        return SPM_TOKENIZER_BYTES_PER_TOKEN
    split = PRE_TOKENIZERS.get(spec.tokenizer_pre or "default")
    if spec.tokenizer_model == "gpt2" and split is not None and split.kernel is not None:
        return BPE_TOKENIZER_BYTES_PER_TOKEN
    return TOKENIZER_BYTES_PER_TOKEN


def runtime_overhead(spec: ModelSpec) -> int:
    """The process before any weight or cache: torch and kvserve imported, and the model's tokenizer."""
    return RUNTIME_OVERHEAD_BYTES + tokenizer_bytes_per_token(spec) * spec.config.vocab_size


@dataclass(frozen=True, slots=True)
class PlanSettings:
    contexts: tuple[int, ...]
    kv_types: tuple[tuple[str, str], ...]  # (K type, V type) pairs to plan
    memory: int  # bytes the model must fit in
    memory_source: str = "--memory"
    max_num_seqs: int = 1
    max_num_batched_tokens: int = 512
    block_size: int = 16
    dtype: str = "float32"  # the engine's compute dtype: weights are dequantized to it at load
    disk_cache_bytes: int | None = None  # --kv-disk-cache-size: the prefix cache's disk tier
    attention: str = "auto"  # the attention kernels planned for: auto = the ones the engine would run here
    threads: int = 0  # the native kernels' threads (each has a workspace); 0: this machine's CPUs
    weights: str = "auto"  # the engine's --weights: auto = q4 for a GGUF (the CPU's default), else dtype
    window_kv: bool = True  # False: --no-window-kv, sliding-window layers keep every token too

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"--attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")
        if self.disk_cache_bytes is not None and self.disk_cache_bytes < 1:
            raise ValueError(f"--kv-disk-cache-size must be >= 1, got {self.disk_cache_bytes}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"context lengths must be >= 1, got {list(self.contexts)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        for k, v in self.kv_types:
            kv_type(k), kv_type(v)


@dataclass(frozen=True, slots=True)
class Activations:
    """Peak working memory of one engine step, in --dtype floats (f) unless noted. An upper bound:
    the terms are summed although not all are alive at once.

    hidden_states  chunk x (hidden + q + k + v + 2 x intermediate) f, chunk = min(budget, ctx); where the
                   native kernels run, the one-call step's buffers instead, held between steps
                   (``native_step_bytes``)
    attention      the larger of two paths, per layer (layers run one after another):
      prefill      one query tile (min(chunk, 1024) queries) against ``keys`` = ctx keys:
                     scores and their softmax  2 x heads x tile x keys f
                     kernel copies of K (scaled) and, with GQA, K and V repeated to every head:
                                               (3 if GQA else 1) x heads x keys x head_dim f
                     the sequence's K and V gathered from the cache (+ decoded to f unless stored as f)
      decode       every running sequence's single query at once: the same copies and gathered K/V for
                   max_num_seqs x ctx keys, with 2 x heads x ctx f of scores per sequence
    logits         one float32 row of vocab per sampled sequence (+ the --dtype row it comes from)
    rope_tables    cos and sin of every position of the context, per RoPE base (Gemma's sliding layers
                   have their own): 2 x ctx x rotated dims f each (models/rope.py grows them to ctx)

    The attention terms follow torch's CPU math kernel (what runs for a masked tile): measured peak
    for a [32 heads, 512, 16384] tile with 8 KV heads, float32: +2.80 GiB, this formula 2.75 GiB.
    Where the native kernels run (``attention_kernels``), attention is their workspace instead
    (``native_attention``): they read the blocks in place, so nothing grows with ctx but the decode
    path's softmax states, one per 256 positions.
    """

    hidden_states: int
    attention: int
    logits: int
    attention_path: str  # "prefill" or "decode": which path is larger
    attention_kernels: str = "torch"  # "native" (tiles read in place, see native_attention) or "torch"
    rope_tables: int = 0

    @property
    def total(self) -> int:
        return self.hidden_states + self.attention + self.logits + self.rope_tables


@dataclass(frozen=True, slots=True)
class ContextPlan:
    ctx: int
    kv_bytes: int  # every layer keeps every token, x max_num_seqs
    # the least sliding-window layers need: min(ctx, window) tokens each, x max_num_seqs (the engine's window
    # pool adds the blocks a window straddles and one step's tokens)
    kv_bytes_windowed: int
    engine_kv_pool_bytes: int  # the pool the engine allocates for this ctx (engine_pool's blocks)
    engine_pool: PoolSize
    activations: Activations
    total: int  # weights as stored + engine_kv_pool_bytes + activations + overhead
    # weights as held + a chunk of rows in flight + engine_kv_pool_bytes + activations + overhead
    engine_total: int


@dataclass(frozen=True, slots=True)
class KVTypePlan:
    cache_type_k: str
    cache_type_v: str
    bits_per_element_k: float
    bits_per_element_v: float
    bytes_per_token: int
    contexts: tuple[ContextPlan, ...]
    max_ctx: int  # largest ctx (<= the model's trained context) whose total fits; 0: none
    engine_max_ctx: int  # the same for the engine total

    def disk_tier(self, max_bytes: int, block_size: int) -> tuple[int, int]:
        """(bytes per block file, tokens) the disk tier of ``max_bytes`` holds in this KV type."""
        file_bytes, blocks = disk_capacity(max_bytes, self.bytes_per_token, block_size)
        return file_bytes, blocks * block_size

    @property
    def name(self) -> str:
        return (
            self.cache_type_k
            if self.cache_type_k == self.cache_type_v
            else f"{self.cache_type_k}/{self.cache_type_v}"
        )


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelSpec
    settings: PlanSettings
    engine_weight_bytes: int  # weights as the engine holds them (weight_format)
    runtime_overhead: int
    kv: tuple[KVTypePlan, ...]
    skipped: tuple[tuple[str, str], ...]  # (KV type, why it cannot store this model's head-vectors)


def windowed_kv_bytes(
    config: ModelConfig, ctx: int, cache_type_k: str, cache_type_v: str | None = None
) -> int:
    """KV bytes of one sequence of ``ctx`` tokens when sliding-window layers keep only their window."""
    per_layer_token = kv_bytes_per_token_per_layer(config, cache_type_k, cache_type_v)
    window = config.sliding_window
    num_sliding = sum(1 for i in range(config.num_layers) if config.is_sliding(i)) if window else 0
    tokens = num_sliding * min(ctx, window or ctx) + (config.num_layers - num_sliding) * ctx
    return tokens * per_layer_token


def attention_kernels(config: ModelConfig, s: PlanSettings) -> str:
    """The attention kernels the engine would run: the native ones on the CPU where they build (a C
    compiler, KVSERVE_NATIVE not 0; gemma2's score cap included), else torch's path."""
    if s.attention != "auto":
        return s.attention
    from kvserve import native

    usable = native.compiler() is not None and os.environ.get("KVSERVE_NATIVE", "1") != "0"
    return "native" if usable and s.dtype == "float32" else "torch"


def native_attention(config: ModelConfig, ctx: int, s: PlanSettings, k: str = "f16") -> tuple[int, str]:
    """Workspace bytes of the native kernels, which read K/V blocks in place (nothing gathered):

    prefill  per thread: a tile of 32 queries x G heads (q, accumulator, max, sum: 2D + 2 floats a row)
             and 64 keys decoded (K, V, K transposed: 3D floats each), plus int16 copies for q8_0/q4_0 keys;
             the chunk's queries rotated once where keys of type k are stored rotated
    decode   per (sequence, kv head, 256-position partition) a softmax state of G x (D + 2) floats,
             per thread the scores of a partition (G x 256) and one decoded block; a rotated query
    """
    c = config
    g, d = c.num_heads // c.num_kv_heads, c.head_dim
    threads = s.threads or os.cpu_count() or 1
    rows = NATIVE_QUERY_TILE * g
    int_keys = 2 * (rows * d + NATIVE_KEY_TILE * d) + 4 * (rows + NATIVE_KEY_TILE * d // 32)
    prefill = threads * (4 * (rows * (2 * d + 2) + NATIVE_KEY_TILE * d * 3) + int_keys)
    if keys_rotated(k, d):
        prefill += 4 * min(s.max_num_batched_tokens, ctx) * c.num_heads * d
    partitions = -(-ctx // NATIVE_PARTITION)
    block_rows = -(-s.block_size // 16) * 16
    decode = (4 * s.max_num_seqs * c.num_kv_heads * partitions * g * (d + 2)
              + threads * 4 * (g * NATIVE_PARTITION + block_rows * d) + 4 * s.max_num_seqs * c.num_heads * d)
    return (decode, "decode") if decode > prefill else (prefill, "prefill")


def activations(config: ModelConfig, ctx: int, k: str, v: str, s: PlanSettings) -> Activations:
    fb = DTYPE_BYTES[s.dtype]
    c = config
    chunk = min(s.max_num_batched_tokens, ctx)
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hidden = chunk * (c.hidden_size + q_dim + 2 * kv_dim + 2 * c.intermediate_size) * fb
    rows = min(s.max_num_seqs, chunk)
    logits = rows * c.vocab_size * (4 if fb == 4 else 4 + fb)
    rope = rope_table_bytes(c, ctx, fb)
    if attention_kernels(c, s) == "native":
        hidden = max(hidden, native_step_bytes(c, chunk))
        attention, path = native_attention(c, ctx, s, k)
        return Activations(hidden, attention, logits, path, "native", rope)
    tile = min(chunk, QUERY_TILE)
    all_sliding = bool(c.sliding_window) and all(c.is_sliding(i) for i in range(c.num_layers))
    keys = min(ctx, c.sliding_window + tile) if all_sliding else ctx
    # per key: the kernel's scaled K (and, with GQA, K and V repeated to every query head)
    copies = (3 if c.num_heads != c.num_kv_heads else 1) * c.num_heads * c.head_dim * fb
    # per gathered token: stored K and V of one layer plus their decoded copy (none when stored as --dtype)
    gathered = c.num_kv_heads * sum(
        kv_type(t).bytes_per_vector(c.head_dim)
        + (0 if kv_type(t).torch_dtype == s.dtype else c.head_dim * fb)
        for t in (k, v)
    )
    prefill = 2 * c.num_heads * tile * keys * fb + keys * copies + ctx * gathered
    decode = s.max_num_seqs * ctx * (copies + gathered + 2 * c.num_heads * fb)
    if decode > prefill:
        return Activations(hidden, decode, logits, "decode", rope_tables=rope)
    return Activations(hidden, prefill, logits, "prefill", rope_tables=rope)


def native_step_bytes(c: ModelConfig, chunk: int) -> int:
    """The one-call step's f32 buffers (models/native_step.py's ``NativeStep._plan``) for the rows of a
    chunk, which it keeps between steps: per row the residual stream and its norm, qkv and q, k, v apart,
    the attention output and the decodes' gathered q and output, the output projection and the MLP (each
    with a post-norm's copy), the step's output, and cos/sin rows (two tables for sliding layers). Buffers
    double up to 256 rows while a batch of decodes grows (``native_step.rows_to_plan``)."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_row = 7 * c.hidden_size + 5 * q_dim + 4 * kv_dim + 3 * c.intermediate_size + 4 * c.head_dim
    return max(chunk, min(2 * chunk, 256)) * per_row * 4


def rope_table_bytes(c: ModelConfig, ctx: int, float_bytes: int) -> int:
    """The RoPE tables at ``ctx`` positions: cos and sin, per base (a second one for Gemma's sliding
    layers)."""
    num_tables = 1 + (c.rope_theta_local is not None)
    return num_tables * 2 * ctx * (c.rotary_dim or c.head_dim) * float_bytes


def context_plan(
    spec: ModelSpec, s: PlanSettings, k: str, v: str, ctx: int, engine_weights: int
) -> ContextPlan:
    c = spec.config
    seqs = s.max_num_seqs
    kv_full = ctx * kv_bytes_per_token(c, k, v) * seqs
    kv_windowed = windowed_kv_bytes(c, ctx, k, v) * seqs
    size, pool = engine_pool(c, ctx, seqs, s.block_size, k, v, s.max_num_batched_tokens, s.window_kv)
    act = activations(c, ctx, k, v, s)
    fixed = act.total + runtime_overhead(spec)
    return ContextPlan(
        ctx=ctx,
        kv_bytes=kv_full,
        kv_bytes_windowed=kv_windowed,
        engine_kv_pool_bytes=pool,
        engine_pool=size,
        activations=act,
        total=spec.stored_bytes + pool + fixed,
        engine_total=engine_weights + in_flight(spec) + pool + fixed,
    )


def in_flight(spec: ModelSpec) -> int:
    """What a load holds beside the weights it has packed: ROW_CHUNK rows of the widest tensor, as stored
    and as float32 (the loader packs a tensor a chunk of rows at a time and drops the mapped file's pages
    behind it). The whole file where no tensor list is known."""
    if not spec.tensors:
        return spec.mapped_bytes
    return max(min(ROW_CHUNK, t.num_elements // t.dims[0]) * t.dims[0] * 4 + t.num_bytes * min(
        1.0, ROW_CHUNK * t.dims[0] / t.num_elements) for t in spec.tensors).__ceil__()


def largest_fit(total: Callable[[int], int], limit: int, memory: int) -> int:
    """Largest ctx in [1, limit] with total(ctx) <= memory (total grows with ctx); 0 when none fits."""
    if total(1) > memory:
        return 0
    if total(limit) <= memory:
        return limit
    lo, hi = 1, limit  # total(lo) fits, total(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= memory else (lo, mid)
    return lo


def weight_format(spec: ModelSpec, s: PlanSettings) -> str:
    """The format the engine holds the weights in: --weights, with auto as the loader resolves it on a
    CPU (q4 for a GGUF in float32, else the dtype)."""
    if s.weights != "auto":
        return s.weights
    return "q4" if spec.tensors and s.dtype == "float32" else s.dtype


def engine_weight_bytes(spec: ModelSpec, s: PlanSettings) -> int:
    fmt = weight_format(spec, s)
    if fmt in ("q4", "q4-fast", "int8") and spec.tensors:
        return held_bytes(spec.tensors, fmt)
    return spec.num_params * DTYPE_BYTES["bfloat16" if fmt == "bf16" else s.dtype]


def make_plan(spec: ModelSpec, s: PlanSettings) -> Plan:
    c = spec.config
    engine_weights = engine_weight_bytes(spec, s)
    plans, skipped = [], []
    for k, v in s.kv_types:
        try:
            bits_k, bits_v = kv_type(k).bits_per_element(c.head_dim), kv_type(v).bits_per_element(c.head_dim)
        except ValueError as e:
            skipped.append((k if k == v else f"{k}/{v}", str(e)))
            continue

        def at(ctx: int, k=k, v=v) -> ContextPlan:
            return context_plan(spec, s, k, v, ctx, engine_weights)

        limit = c.max_position_embeddings
        plans.append(
            KVTypePlan(
                k,
                v,
                bits_k,
                bits_v,
                kv_bytes_per_token(c, k, v),
                tuple(at(ctx) for ctx in s.contexts),
                largest_fit(lambda n: at(n).total, limit, s.memory),
                largest_fit(lambda n: at(n).engine_total, limit, s.memory),
            )
        )
    if not plans:
        raise ValueError("no KV cache type can store this model: " + "; ".join(r for _, r in skipped))
    return Plan(spec, s, engine_weights, runtime_overhead(spec), tuple(plans), tuple(skipped))


def available_memory() -> tuple[int, str]:
    """This machine's available memory: MemAvailable from /proc/meminfo, else free pages from sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"
    except (ValueError, OSError, AttributeError):
        raise ValueError(
            "cannot tell this machine's available memory; give it with --memory (e.g. 16GiB)"
        ) from None


def measure_runtime_overhead() -> int:
    """Resident bytes of a fresh ``python -c "import torch, kvserve"`` (takes seconds: not for tests)."""
    code = "import torch, kvserve; print(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[1]) * 1024

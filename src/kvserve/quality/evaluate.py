"""``evaluate``: one row per K/V cache type pair, the f32 cache as the reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv.codecs import make_codec
from kvserve.models.loader import LoadedModel
from kvserve.quality.needle import needle_score
from kvserve.quality.teacher_forced import reference_run, score


@dataclass(slots=True)
class EvalRow:
    cache_type_k: str
    cache_type_v: str
    bits_per_element: float  # mean of K and V, scales and norms included
    kld: float
    top1_agreement: float  # percent
    ppl: float
    delta_ppl: float
    needle: float | None  # fraction found, None when not run

    def as_dict(self) -> dict:
        return asdict(self)


def parse_type_pairs(spec: str) -> list[tuple[str, str]]:
    """"f16,q8_0,q8_0/tq3" -> [(f16, f16), (q8_0, q8_0), (q8_0, tq3)]: K/V written as K/V."""
    pairs = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        k, _, v = item.partition("/")
        pairs.append((k, v or k))
    if not pairs:
        raise ValueError("--cache-types is empty")
    return pairs


def evaluate(
    loaded: LoadedModel,
    token_ids: list[int],
    pairs: list[tuple[str, str]],
    chunk: int = 256,
    needle_lengths: list[int] | None = None,
    needle_depths: list[float] = (0.1, 0.5, 0.9),
    on_row=None,
) -> list[EvalRow]:
    model = loaded.model
    for k, v in pairs:  # fail fast on a bad name before any long run
        make_codec(k, model.config.head_dim), make_codec(v, model.config.head_dim)
    reference = reference_run(model, token_ids, chunk)
    base = score(model, token_ids, reference, "f32", "f32", chunk)
    filler = token_ids
    rows = []
    for k, v in pairs:
        s = base if (k, v) == ("f32", "f32") else score(model, token_ids, reference, k, v, chunk)
        needle = None
        if needle_lengths and loaded.tokenizer is not None:
            engine = _engine(loaded, k, v, max(needle_lengths) + 64, len(needle_lengths) * len(needle_depths))
            needle = needle_score(engine, filler, needle_lengths, list(needle_depths))
        bits = (make_codec(k, model.config.head_dim).bits_per_element()
                + make_codec(v, model.config.head_dim).bits_per_element()) / 2
        row = EvalRow(k, v, bits, s.kld, s.top1_agreement, s.ppl, s.ppl - base.ppl, needle)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def _engine(loaded: LoadedModel, k: str, v: str, num_ctx: int, num_seqs: int) -> LLMEngine:
    config = EngineConfig(
        model=str(loaded.path),
        cache=CacheConfig(num_ctx=num_ctx, cache_type_k=k, cache_type_v=v),
        scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=1024),
    )
    return LLMEngine(config, loaded)

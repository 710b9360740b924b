"""``evaluate``: one row per K/V cache type pair, the f32 cache as the reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvserve.kv.codecs import make_codec
from kvserve.models.loader import LoadedModel
from kvserve.quality.needle import Needle
from kvserve.quality.teacher_forced import pooled, reference_run, score


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
    top1_by_window: list[float] = field(default_factory=list)  # each window's top-1 %, in text order
    engine: str = "kvserve"  # or "llama.cpp": a peer's row (``--compare llama.cpp``)

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
    needle: Needle | None = None,
    on_row=None,
    windows: int = 1,
    score_from: int = 0,
) -> list[EvalRow]:
    """``windows`` > 1: ``token_ids`` cut into that many equal windows, each teacher-forced from an empty
    cache and the scores pooled over all their positions (the top-1 of one 1K window moves by up to a
    percent between neighbouring windows of a text; more windows at the same context say what a type
    costs with less of that noise). ``score_from``: each window's first scored position (llama.cpp's
    ``llama-perplexity`` scores the second half of each window: ``window // 2``). ``needle``: the
    needle-in-a-haystack trials each pair also runs, if any."""
    model = loaded.model
    for k, v in pairs:  # fail fast on a bad name before any long run
        make_codec(k, model.config.head_dim), make_codec(v, model.config.head_dim)
    size = len(token_ids) // windows if windows >= 1 else 0
    if size < 2:
        raise ValueError(f"cannot cut {len(token_ids)} tokens into {windows} windows")
    scores: dict[tuple[str, str], list] = {pair: [] for pair in [("f32", "f32"), *pairs]}
    for w in range(windows):  # one window's f32 log-probs in memory at a time
        span = token_ids[w * size : (w + 1) * size]
        reference = reference_run(model, span, chunk)
        for pair, parts in scores.items():
            parts.append(score(model, span, reference, *pair, chunk, score_from))
        del reference
    base = pooled(scores[("f32", "f32")])
    rows = []
    for k, v in pairs:
        s = pooled(scores[(k, v)])
        found = needle.score(k, v) if needle is not None and (k, v) in needle.pairs else None
        bits = (make_codec(k, model.config.head_dim).bits_per_element()
                + make_codec(v, model.config.head_dim).bits_per_element()) / 2
        row = EvalRow(k, v, bits, s.kld, s.top1_agreement, s.ppl, s.ppl - base.ppl, found,
                      [p.top1_agreement for p in scores[(k, v)]])
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


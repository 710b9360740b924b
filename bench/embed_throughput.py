"""Sentence embeddings per second: kvserve's encoder (``models/encoder.py``, as ``/v1/embeddings`` runs it)
beside sentence-transformers on the same folder, same process, same threads, alternating runs.

    .venv/bin/python bench/embed_throughput.py [--model all-minilm] [--sentences 512] [--batch 32] [--runs 3]

The sentences are the standard library's help topics (``pydoc_data.topics``) cut into sentences of 8 to 64
words, shuffled with a fixed seed, so lengths vary as a RAG pipeline's chunks do. Each side embeds them all
in batches of --batch (sentence-transformers sorts by length inside ``encode``; kvserve's server does the
same for a request), and the cosine of each pair of vectors is reported too.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time

import torch


def sentences(count: int) -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics.values())
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 8 <= len(s.split()) <= 64]
    random.Random(0).shuffle(found)
    return found[:count]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all-minilm")
    p.add_argument("--sentences", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--weights", default="f32", choices=["f32", "int8"], help="the encoder's projections")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from kvserve.models.encoder import Encoder, length_batches
    from kvserve.models.registry import resolve

    path = resolve(args.model, auto_pull=True)
    ours, theirs = Encoder(path, args.model, args.weights), SentenceTransformer(str(path), device="cpu")
    texts = sentences(args.sentences)
    tokens = sum(len(ids) for ids in ours.tokenize(texts))
    print(
        f"{len(texts)} sentences, {tokens} tokens ({tokens / len(texts):.1f} a sentence), batch "
        f"{args.batch}, "
          f"{args.threads} threads")

    def run_ours() -> torch.Tensor:  # what /v1/embeddings does with a request of these texts
        ids = ours.tokenize(texts)
        out = torch.empty(len(ids), ours.config.dimensions)
        for batch in length_batches(ids, args.batch):
            out[batch] = ours.embed([ids[i] for i in batch])
        return out

    def run_theirs() -> torch.Tensor:
        return torch.from_numpy(theirs.encode(texts, batch_size=args.batch, normalize_embeddings=False))

    run_ours(), run_theirs()  # warm up
    times: dict[str, list[float]] = {"kvserve": [], "sentence-transformers": []}
    for _ in range(args.runs):
        for name, fn in (("kvserve", run_ours), ("sentence-transformers", run_theirs)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    a, b = run_ours(), run_theirs()
    cos = torch.nn.functional.cosine_similarity(a, b.to(a.dtype), dim=-1)
    rates = {name: len(texts) / statistics.median(t) for name, t in times.items()}
    for name, rate in rates.items():
        print(f"{name:<22} {rate:8.1f} sentences/s   (runs: {', '.join(f'{x:.2f}' for x in times[name])} s)")
    print(
        f"ratio {rates['kvserve'] / rates['sentence-transformers']:.2f}x; cosine min {float(cos.min()):.6f}")


if __name__ == "__main__":
    main()

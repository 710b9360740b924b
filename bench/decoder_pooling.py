"""A decoder's documents per second as an LLM-style reranker (``DecoderReranker``, as ``/v1/rerank`` runs it):
through its engine (every document a pooling request, batched in the scheduler's chunked prefill) beside one
forward per document over a contiguous KV cache (how it ran before it went through the engine), same
process, same threads, alternating runs; and the largest difference of their scores.

    .venv/bin/python bench/decoder_pooling.py [--model qwen2.5-coder-0.5b] [--documents 64] [--callers 1,4]

The documents are the standard library's help topics cut into sentences (``embed_throughput.sentences``).
``--callers N``: N clients at once, each scoring its share of the documents in batches of 32, as N
concurrent rerank requests would. A benchmark, not a test: the figures are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from embed_throughput import sentences  # bench/ is the script's folder: on sys.path

BATCH = 32  # rerank_api's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--documents", type=int, default=64)
    p.add_argument("--callers", default="1,4")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--weights", default="q4", choices=["f32", "q4"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from kvserve.attention.contiguous import ContiguousKVCache
    from kvserve.embedding.decoder_encoder import DecoderReranker
    from kvserve.models.registry import resolve

    reranker = DecoderReranker(resolve(args.model, auto_pull=True), args.model, args.weights)
    pairs = reranker.tokenize_pairs("How do I read a file line by line?", sentences(args.documents))
    model = reranker.loaded.model
    tokens = sum(len(ids) for ids, _ in pairs)
    print(f"{args.model} ({args.weights}), {len(pairs)} documents, {tokens} tokens "
          f"({tokens / len(pairs):.0f} a prompt), {args.threads} threads")

    @torch.inference_mode()
    def one_at_a_time() -> torch.Tensor:
        scores = []
        for ids, _ in pairs:
            hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)),
                                   ContiguousKVCache(len(model.layers)))
            logits = model.compute_logits(hidden[-1:])[0]
            scores.append(torch.stack([logits[reranker.no], logits[reranker.yes]]).softmax(0)[1])
        return torch.stack(scores)

    def engine(callers: int) -> torch.Tensor:
        shares = [pairs[i::callers] for i in range(callers)]

        async def caller(share) -> list[torch.Tensor]:
            return [await reranker.ascore(share[i : i + BATCH]) for i in range(0, len(share), BATCH)]

        async def all_callers():
            return await asyncio.gather(*(caller(s) for s in shares))

        results = asyncio.run(all_callers())
        out = torch.empty(len(pairs))
        for i, parts in enumerate(results):
            out[i::callers] = torch.cat(parts)
        return out

    ways = {"one at a time": one_at_a_time} | {
        f"engine, {n} caller{'s' if n > 1 else ''}": (lambda n=n: engine(n)) for n in map(
            int, args.callers.split(","))}
    reference = one_at_a_time()
    diff = max(float((fn() - reference).abs().max()) for fn in ways.values())  # warm up; and the scores agree
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.runs):
        for name, fn in ways.items():
            start = time.perf_counter()
            scores = fn()
            times[name].append(time.perf_counter() - start)
            diff = max(diff, float((scores - reference).abs().max()))
    base = len(pairs) / statistics.median(times["one at a time"])
    for name, t in times.items():
        rate = len(pairs) / statistics.median(t)
        print(
            f"{name:<22} {rate:7.1f} documents/s  {rate / base:5.2f}x   (runs: "
            f"{', '.join(f'{x:.2f}' for x in t)} s)")
    print(f"largest score difference from one at a time: {diff:.2e}")
    reranker.close()


if __name__ == "__main__":
    main()

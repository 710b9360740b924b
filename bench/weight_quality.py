"""Quality of each weight format against f32 weights, and of llama.cpp on the same GGUF file: mean KL
divergence and top-1 agreement of the next-token distributions, teacher-forced over 1,024 tokens of
text (``pydoc_data.topics``, as ``kvserve eval`` uses). The f32 run is the reference for all.

    .venv/bin/python bench/weight_quality.py [--model smollm2] [--formats q4,q4-fast,int8,bf16] [--llama-cpp]

``--llama-cpp`` needs the peer installed (``make bench`` or ``pip install .[peers]``); it evaluates the
same token ids with ``logits_all`` and f16 KV (whose own cost is ~0, see the KV table in docs/kv-cache.md).
"""

from __future__ import annotations

import argparse

import torch

from kvserve.models.loader import load_model
from kvserve.quality.teacher_forced import chunk_logprobs
from kvserve.quality.text import default_text


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || other), top-1 agreement in %) of two [positions, vocab] log-prob tensors."""
    kld = float((reference.exp() * (reference - other)).sum(-1).mean())
    top1 = 100 * float((reference.argmax(-1) == other.argmax(-1)).float().mean())
    return kld, top1


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    return torch.cat([lp for _, lp in chunk_logprobs(model, ids, "f32", "f32", 256)])


def llama_cpp_logprobs(path: str, ids: list[int], threads: int) -> torch.Tensor:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2 * len(ids), n_threads=threads, n_threads_batch=threads, n_batch=512,
                logits_all=True, verbose=False)
    llm.eval(ids[:-1])
    return torch.log_softmax(torch.tensor(np.array(llm.scores[: len(ids) - 1]), dtype=torch.float32), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--formats", default="q4,q4-fast,int8,bf16")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--llama-cpp", action="store_true", help="also the llama.cpp peer on the same file")
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference = load_model(args.model, weight_format="f32")
    ids = reference.tokenizer.encode(default_text())[: args.tokens]
    expected = model_logprobs(reference.model, ids)
    print(f"{'weights':<12} {'KLD vs f32':>11} {'top-1 %':>8}   ({len(ids) - 1} positions)")
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        kld, top1 = compare(expected, model_logprobs(load_model(args.model, weight_format=fmt).model, ids))
        print(f"{fmt:<12} {kld:>11.6f} {top1:>8.1f}")
    if args.llama_cpp:
        kld, top1 = compare(expected, llama_cpp_logprobs(str(reference.path), ids, args.threads))
        print(f"{'llama.cpp':<12} {kld:>11.6f} {top1:>8.1f}")


if __name__ == "__main__":
    main()

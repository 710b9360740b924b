"""What q8_0 keys lose to a model's outlier channels, and what centring and rotating them would win back.

Qwen2.5's K projection has a bias with entries up to ~145 (layer 0) against keys of magnitude ~1-5;
they sit in RoPE's lowest-frequency pairs, which barely turn over a context, so each group of 32 that
holds one is quantized with a step ~145/127 and the rest of the group drowns. Two remedies, measured here
on the torch reference path (teacher-forced KLD and top-1 against the f32 cache, V kept f16):

    centred   keys stored minus a fixed vector mu per layer and kv head: mu = the K bias on the RoPE pairs
              that turn less than --max-angle radians over 32K positions (0 elsewhere). Exact for
              attention: every score of a query moves by the same q . mu, and softmax ignores that.
    rotated   keys stored times a random-sign Hadamard matrix R (the tq codecs' rotation), the query
              rotated alike (q . k = Rq . Rk): an outlier is spread over all D coordinates.

The engine now does both (``codecs.RotatedKeys``, ``DecoderLM.key_centres``); this script turns them off
and on one at a time, on the torch path, to show what each is worth.

    .venv/bin/python bench/kv_key_outliers.py qwen2.5-coder-0.5b [--text FILE] [--ctx 1024] [--max-angle 3]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from gguf import GGUFReader

from kvserve.attention import native_paged, paged
from kvserve.kv import codecs
from kvserve.kv import storage as storage_module
from kvserve.kv.storage import PagedKVStorage
from kvserve.models.loader import load_model
from kvserve.models.registry import resolve
from kvserve.quality.teacher_forced import reference_run, score
from kvserve.quality.text import load_text


def key_centres(path: str, head_dim: int, rope_theta: float, max_angle: float) -> dict[int, torch.Tensor]:
    """Per layer, mu [kv_heads, head_dim]: the K bias on the pairs (i, i + D/2) that RoPE turns less
    than max_angle radians over 32K positions, zero elsewhere; {} for a model without a K bias."""
    half = head_dim // 2
    theta = rope_theta ** (-2 * torch.arange(half) / head_dim)
    keep = (theta * 32768 < max_angle).float().repeat(2)
    centres = {}
    for t in GGUFReader(path).tensors:
        if t.name.endswith("attn_k.bias"):
            bias = torch.tensor(np.array(t.data, dtype=np.float32)).view(-1, head_dim)
            centres[int(t.name.split(".")[1])] = bias * keep
    return centres


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", default=None, help="UTF-8 text file (default: Python's pydoc topics)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-angle", type=float, default=3.0)
    args = ap.parse_args()

    path = str(resolve(args.model))
    loaded = load_model(path)
    model, cfg = loaded.model, loaded.model.config
    ids = loaded.tokenizer.encode(load_text(args.text))[: args.ctx]
    centres = key_centres(path, cfg.head_dim, cfg.rope_theta, args.max_angle)

    # the torch reference path: the kernels know neither remedy
    native_paged.for_storage = paged.native_paged.for_storage = lambda storage: None
    native_paged.writer_for_storage = paged.native_paged.writer_for_storage = lambda storage: storage.write
    mode = {"centred": False, "rotated": False}
    make_codec, write = storage_module.make_codec, PagedKVStorage.write

    def codec(name, head_dim, keys=False):
        rotated = mode["rotated"] and keys and name == "q8_0"
        return codecs.RotatedKeys(codecs.Q8_0Codec(head_dim)) if rotated else make_codec(name, head_dim)

    def centred_write(self, layer, rows, k, v):
        if mode["centred"] and layer in centres:
            k = k - centres[layer].to(k.dtype)
        return write(self, layer, rows, k, v)

    storage_module.make_codec, PagedKVStorage.write = codec, centred_write
    model.key_centres = lambda: None  # the engine's own centring off: this script's mode decides
    model.key_balance = lambda: None  # and its balance (models/key_balance.py), which it does not measure
    reference = reference_run(model, ids, 256)
    rows = []
    for centred in (False, True) if centres else (False,):
        for rotated in (False, True):
            mode.update(centred=centred, rotated=rotated)
            s = score(model, ids, reference, "q8_0", "f16", 256)
            rows.append({"keys": "+".join(n for n, on in mode.items() if on) or "plain", "kld": s.kld,
                         "top1": s.top1_agreement, "ppl": s.ppl})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()

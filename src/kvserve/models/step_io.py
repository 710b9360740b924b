"""The one-call step's two ends in numpy: the embedding rows that go in, the LM head's logits that come
out (``models/native_step.py``), each as the same kernel calls ``DecoderLM`` makes, so the same bits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvserve import native
from kvserve.models.linear import Int4Linear, StackedLinear, bias_address

if TYPE_CHECKING:
    from kvserve.models.decoder import DecoderLM


def embedding_lookup(model: DecoderLM):
    """``model.embed_tokens`` for the one-call step, as ``(ids [n] int64, out f32 [n, hidden]) -> out`` in
    numpy: the f32 table read through a numpy view of its memory, the file's rows dequantized by the gguf
    library (``QuantRows``), or the tied int8 head's rows through its kernel."""
    if model.embed is not None:
        table = model.embed.numpy()
        return lambda ids, out: np.take(table, ids, axis=0, out=out)
    if model.embed_rows is not None:
        quant_rows = model.embed_rows

        def dequantized(ids: np.ndarray, out: np.ndarray) -> np.ndarray:
            out[...] = quant_rows.row_array(ids)
            return out

        return dequantized
    head = model.lm_head
    kernel = native.function("int8_matmul", "int8_rows_g16" if head.layout == "g16" else "int8_rows")
    packed, width = head.packed.ctypes.data, head.in_features

    def int8_rows(ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        kernel(packed, ids.ctypes.data, ids.shape[0], width, out.ctypes.data)
        return out

    return int8_rows


class HeadMatmul:
    """The LM head's projection as its kernel calls, each part's weights, bias and columns taken once."""

    def __init__(self, parts: list[tuple], in_features: int, out_features: int) -> None:
        self.parts, self.in_features, self.out_features = parts, in_features, out_features

    @classmethod
    def for_model(cls, model: DecoderLM, kernel_name) -> HeadMatmul | None:
        """The head's calls, or None where ``kernel_name(head)`` (the step's) names no kernel for it or
        the model divides or caps its logits (``compute_logits`` does that in torch)."""
        head, cfg = model.lm_head, model.config
        if kernel_name(head) is None or cfg.logits_divisor != 1.0 or cfg.final_logit_softcap:
            return None
        parts, first = [], 0
        for part in head.parts if isinstance(head, StackedLinear) else [head]:
            options = (part.digits, part.layout) if isinstance(part, Int4Linear) else ()
            bias = bias_address(part.bias)
            parts.append((part.kernel, part.packed.ctypes.data, bias, part.out_features, first, options))
            first += part.out_features
        return cls(parts, head.in_features, head.out_features)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(hidden, dtype=np.float32)
        m, threads = x.shape[0], native.num_threads()
        y = np.empty((m, self.out_features), np.float32)
        for kernel, packed, bias, n, first, options in self.parts:
            rc = kernel(x.ctypes.data, packed, bias, m, n, self.in_features, y.ctypes.data + 4 * first,
                        threads, *options, self.out_features)
            if rc != 0:
                raise MemoryError("native matmul: could not allocate the activation digits")
        return y

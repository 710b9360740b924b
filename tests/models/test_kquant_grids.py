"""GGUF's K-quants held in their own grids: Q4_K as 4-bit groups with f32 scales and offsets (``Int4Linear``)
in the q4 formats, and by the int8 groups (``Int8GroupLinear``'s f32 scales and offsets per 16 inputs) in the
int8 format and for Q6_K: Gemma 3 270M's Q4_K and Q6_K tensors, read from the real file, the same bits as
the gguf library's dequantization; and the arithmetic of such groups against float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.models.block_layouts import QL_F32
from kvserve.models.gguf_file import GGUFFile, GGUFWeights
from kvserve.models.linear import Int4Linear, Int8GroupLinear, make_linear
from kvserve.models.registry import resolve
from kvserve.models.weight_grids import int8_groups16, pack_int8_groups16

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemma_weights():
    from kvserve.models.gguf_config import read_model_config

    gf = GGUFFile(resolve("gemma3-270m"))
    return gf, GGUFWeights(gf, read_model_config(gf.header))


@pytest.mark.parametrize("name, qtype",
                         [("blk.0.attn_output.weight", "Q4_K"), ("blk.0.ffn_down.weight", "Q6_K"),
                                         ("blk.2.ffn_down.weight", "Q4_K")])
def test_gemma3_k_quant_tensors_are_held_exactly(gemma_weights, name, qtype):
    gf, weights = gemma_weights
    assert gf.tensors[name].type_name == qtype
    weight = gf.load_tensor(name)  # the gguf library's dequantization
    lin = make_linear(weight, None, "q4", CPU, torch.float32, weights.grid16(name))  # decoded when needed
    if qtype == "Q4_K":  # 4-bit groups of 32 with the file's scales and offsets (products f16 cannot hold)
        assert isinstance(lin, Int4Linear) and lin.layout == QL_F32
    else:
        assert isinstance(lin, Int8GroupLinear) and lin.layout == "g16"
    assert torch.equal(lin.weight, weight)
    int8 = make_linear(weight, None, "int8", CPU, torch.float32, weights.grid16(name))
    assert isinstance(int8, Int8GroupLinear) and int8.layout == "g16" and torch.equal(int8.weight, weight)
    if qtype == "Q6_K":  # symmetric: found from the values alone
        assert weights.grid16(name) is None and int8_groups16(weight) is not None
    else:  # Q4_K's codes need not span 0..15: only the file says its grid; without it, Q8_0's grid
        assert int8_groups16(weight) is None
        rounded = make_linear(weight, None, "int8", CPU, torch.float32)
        assert isinstance(rounded, Int8GroupLinear) and rounded.layout == "g32"
        groups = weight.view(weight.shape[0], -1, 32)
        step = groups.abs().amax(-1, keepdim=True) / 127  # d of each group of 32, before its f16 rounding
        error = (rounded.weight.view_as(groups) - groups).abs()
        # half a step, and the f16 scale's rounding (measured 0.5002)
        assert bool((error <= 0.501 * step).all())


def test_the_loaded_gemma3_holds_every_projection_exactly(gemma_weights):
    """No tensor of the model rounded: each projection's weights are the file's (two layers checked: every
    type the file has)."""
    from kvserve.models.loader import load_model

    gf, _ = gemma_weights
    model = load_model("gemma3-270m", weight_format="q4").model
    for i in (0, 2):  # layer 0: Q6_K down, layer 2: Q4_K down
        layer, p = model.layers[i], f"blk.{i}."
        qkv = torch.cat([gf.load_tensor(p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")])
        gate_up = torch.cat([gf.load_tensor(p + n) for n in ("ffn_gate.weight", "ffn_up.weight")])
        for lin, exact in ((layer.qkv, qkv), (layer.o, gf.load_tensor(p + "attn_output.weight")),
                           (layer.gate_up, gate_up), (layer.down, gf.load_tensor(p + "ffn_down.weight"))):
            assert torch.equal(lin.weight, exact)


def test_groups16_arithmetic_with_offsets_against_float64():
    """Codes 0..15, f32 scales and offsets per 16 inputs: the product within the activations' int16
    rounding of x @ W.T, and each row the same bits alone or batched."""
    g = torch.Generator().manual_seed(7)
    n, k = 72, 160
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    scales, offsets = torch.rand(n, k // 16, generator=g) * 0.01 + 1e-4, -torch.rand(
        n, k // 16, generator=g) * 0.1
    weight = (codes.float().view(n, -1, 16) * scales[..., None] + offsets[..., None]).view(n, k)
    lin = Int8GroupLinear(weight, None, (codes, scales, offsets))
    assert lin.layout == "g16" and torch.equal(lin.weight, weight)
    assert lin.packed.shape == pack_int8_groups16(codes, scales, offsets).shape
    x = torch.randn(11, k, generator=g) * torch.linspace(0.01, 30, k)
    y = lin(x)
    exact = x.double() @ weight.double().T
    assert float((y.double() - exact).norm() / exact.norm()) < 1e-4
    for i in (0, 10):
        assert torch.equal(lin(x[i : i + 1])[0], y[i])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_1"])
def test_affine_grids_from_the_blocks_are_the_librarys_dequantization(qtype):
    """Q4_1 and Q5_1 (w = d * q + m per 32) as the gguf library quantizes them: the grid decoded from the
    blocks, held by the int8 groups, gives its dequantization back bit for bit (a Q4_1 group that does not
    span 0..15 cannot be the 4-bit kernel's, nor found from the values)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kvserve.models.gguf_file import GRID_DECODERS

    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(8)).numpy()
    x[:, :32] *= np.linspace(0.01, 1, 32)  # groups of every spread
    raw = quantize(x, GGMLQuantizationType[qtype])
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
    grid = GRID_DECODERS[qtype](raw.reshape(-1), *weight.shape)  # a tuple; the loader passes a function
    lin = make_linear(weight, None, "int8", CPU, torch.float32, grid)
    assert lin.layout == "g16" and torch.equal(lin.weight, weight)


@pytest.mark.parametrize("qtype, size", [("Q4_K", 144), ("Q5_K", 176), ("Q4_1", 20), ("Q5_1", 24)])
def test_grids_of_random_blocks_are_the_librarys_dequantization(qtype, size):
    """Any bytes are a valid block but for the f16 scales: random blocks (their scales made finite and
    small) decoded by GRID_DECODERS and held by the int8 groups give the gguf library's dequantization
    back bit for bit (K-quants cannot be made with the library's quantize)."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvserve.models.gguf_file import GRID_DECODERS

    rng = np.random.default_rng(9)
    rows, cols = 32, 512
    blocks = rng.integers(0, 256, (rows * cols // (256 if "K" in qtype else 32), size), dtype=np.uint8)
    scales = (rng.random((blocks.shape[0], 2)) * 0.02 + 1e-4).astype(np.float16)
    blocks[:, 0:4] = scales.view(np.uint8).reshape(-1, 4)  # d and dmin (or m) first in every type here
    weight = torch.from_numpy(dequantize(blocks.reshape(rows, -1), GGMLQuantizationType[qtype]))
    lin = make_linear(weight, None, "int8", CPU, torch.float32,
                      GRID_DECODERS[qtype](blocks.reshape(-1), rows, cols))
    assert lin.layout == "g16" and torch.equal(lin.weight, weight)


@pytest.mark.parametrize("qtype, size, f32_scales", [("Q4_K", 144, True), ("Q4_1", 20, False)])
def test_four_bit_grids_run_as_four_bit_groups(qtype, size, f32_scales):
    """Random Q4_K and Q4_1 blocks (codes that need not span 0..15) in the q4 format: 4-bit groups holding the
    gguf library's dequantization bit for bit (f32 scales only where f16 cannot hold them), the product
    within the activations' rounding of float64's, each row the same bits alone or batched."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvserve.models.gguf_file import GRID_DECODERS

    rng = np.random.default_rng(10)
    rows, cols = 40, 512
    blocks = rng.integers(0, 256, (rows * cols // (256 if "K" in qtype else 32), size), dtype=np.uint8)
    scales = (rng.random((blocks.shape[0], 2)) * 0.02 + 1e-4).astype(np.float16)
    blocks[:, 0:4] = scales.view(np.uint8).reshape(-1, 4)
    weight = torch.from_numpy(dequantize(blocks.reshape(rows, -1), GGMLQuantizationType[qtype]))
    lin = make_linear(weight, None, "q4", CPU, torch.float32,
                      lambda: GRID_DECODERS[qtype](blocks.reshape(-1), rows, cols))
    assert isinstance(lin, Int4Linear) and (lin.layout == QL_F32) == f32_scales
    assert torch.equal(lin.weight, weight)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(11)) * torch.linspace(0.01, 30, cols)
    y = lin(x)
    exact = x.double() @ weight.double().T
    assert float((y.double() - exact).norm() / exact.norm()) < 1e-4
    for i in (0, 8):
        assert torch.equal(lin(x[i : i + 1])[0], y[i])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0"])
def test_symmetric_grids_from_the_blocks_are_the_librarys_dequantization(qtype):
    """Q8_0, Q5_0 and Q4_0 decoded from their blocks by chunks of rows (the tied head's path, which never
    dequantizes the embedding): held as int8 groups, the gguf library's dequantization bit for bit."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from kvserve.models.gguf_file import symmetric_grid

    rows, cols = 4100, 64  # past one chunk of 4,096 rows
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(12)).numpy()
    raw = quantize(x, GGMLQuantizationType[qtype])
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
    lin = Int8GroupLinear.from_grid32(rows, cols, symmetric_grid(raw.reshape(-1), rows, cols, qtype))
    assert torch.equal(lin.weight, weight)
    if qtype == "Q8_0":  # the grid the values give (Q5_0's and Q4_0's: equal weights, other scales)
        assert np.array_equal(lin.packed, Int8GroupLinear(weight, None).packed)


def test_the_tied_heads_come_from_the_files_blocks(gemma_weights):
    """SmolLM2's and Gemma 3's tied Q8_0 embeddings become the int8 head without an f32 copy: the head's
    rows (the embedding lookups) are the file's dequantized rows."""
    from kvserve.models.loader import load_model

    gf, _ = gemma_weights
    model = load_model("gemma3-270m", weight_format="q4").model
    assert model.embed is None
    ids = torch.tensor([0, 1, 2, 106, 262143])
    assert torch.equal(model.lm_head.rows(ids), gf.load_tensor("token_embd.weight")[ids])

"""GGUF block types held in their file's bits (models/block_layouts.py, native/int4_matmul.c's layouts):
each type's packed weights give the gguf library's dequantization back exactly, the kernel's product is
float64's within the activations' rounding, each row the same bits alone or batched; the real files'
tensors (Gemma 3's Q4_K/Q5_0/Q6_K, Qwen2.5-Coder's) are held exactly by the loaded models, and an
embedding kept as file bytes looks rows up as the f32 table did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.models import block_layouts, layouts
from kvserve.models.gguf_file import GGUFFile
from kvserve.models.linear import Int4Linear
from kvserve.models.registry import resolve
from tests.support import BLOCK_TYPES, random_blocks

pytestmark = pytest.mark.skipif(not Int4Linear.native(),
                                reason="no C compiler: the packed layouts need the kernel")


def dequantized(raw: np.ndarray, type_name: str, rows: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.reshape(rows, -1),
                                       GGMLQuantizationType[type_name]).astype(np.float32))


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_each_type_packs_to_its_file_bytes_and_back(type_name):
    rows, cols = 40, 512
    raw = random_blocks(type_name, rows, cols, seed=1)
    lin = Int4Linear.from_blocks(raw, type_name, rows, cols)
    assert torch.equal(lin.weight, dequantized(raw, type_name, rows))
    per_weight = lin.nbytes / (-(-rows // 16) * 16 * cols)  # outputs padded to panels of 16
    file_per_weight = raw.size / (rows * cols)
    # Q4_K, Q5_K, Q3_K: scales widened to a byte
    assert file_per_weight <= per_weight <= 1.04 * file_per_weight


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("fast", [False, True])
def test_each_type_multiplies_within_the_activations_rounding(type_name, fast):
    rows, cols = 56, 768 if "K" in type_name else 96
    raw = random_blocks(type_name, rows, cols, seed=2)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(3))
    lin = Int4Linear.from_blocks(raw, type_name, rows, cols, bias, fast)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(4)) * torch.linspace(0.01, 30, cols)
    y = lin(x)
    exact = x.double() @ dequantized(raw, type_name, rows).double().T + bias.double()
    error = float((y.double() - exact).norm() / exact.norm())
    assert error < (2e-2 if fast else 2e-4), error  # measured ~5e-3 and ~4e-5
    for r in (0, 5, 12):  # each row alone: the same bits as in the batch
        assert torch.equal(lin(x[r : r + 1]), y[r : r + 1])


def test_a_wrong_layout_is_refused_by_the_kernel():
    from kvserve.models.linear import _int4_matmul_kernel

    x, y = torch.zeros(1, 32), torch.zeros(1, 16)
    w = torch.zeros(512, dtype=torch.uint8)
    assert _int4_matmul_kernel()(x.data_ptr(), w.data_ptr(), None, 1, 16, 32, y.data_ptr(), 1, 2, 99, 0) == -1


@pytest.fixture(scope="module")
def qwen():
    return GGUFFile(resolve("qwen2.5-coder-0.5b"))


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight"])
def test_qwen_file_tensors_are_held_exactly(qwen, name):
    """Q6_K, Q4_K and Q5_0 tensors of the real file, packed from its bytes."""
    t = qwen.tensors[name]
    rows, cols = t.dims[1], t.dims[0]
    lin = Int4Linear.from_blocks(qwen.tensor_bytes(name), t.type_name, rows, cols)
    assert torch.equal(lin.weight, qwen.load_tensor(name))


def test_the_loaded_qwen_holds_its_file(qwen):
    """Every projection from the file's blocks (none re-rounded), the head as the file's Q8_0 grid, the
    untied Q5_0 embedding as the file's bytes: its lookups are load_tensor's rows."""
    from kvserve.models.linear import Int8GroupLinear
    from kvserve.models.loader import load_model

    model = load_model("qwen2.5-coder-0.5b", weight_format="q4").model
    assert model.embed is None and model.embed_rows is not None
    ids = torch.tensor([0, 17, 151_935, 17])
    table = qwen.load_tensor("token_embd.weight")
    assert torch.equal(model.embed_tokens(ids), table[ids])
    assert isinstance(model.lm_head, Int8GroupLinear) and torch.equal(model.lm_head.weight,
                                                                      qwen.load_tensor("output.weight"))
    # Q5_0 q/k with a Q8_0 v (layer 0: int8 groups), with a Q5_0 v (layer 1); Q6_K / Q4_K down
    for i in (0, 1):
        layer, p = model.layers[i], f"blk.{i}."
        qkv = torch.cat([qwen.load_tensor(p + f"attn_{s}.weight") for s in "qkv"])
        assert torch.equal(layer.qkv.weight, qkv), i
        assert torch.equal(layer.down.weight, qwen.load_tensor(p + "ffn_down.weight")), i
        assert isinstance(layer.down, Int4Linear) and layer.down.layout == layouts.GGUF_LAYOUTS[
            qwen.tensors[p + "ffn_down.weight"].type_name][0]


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_the_native_repack_writes_the_reference_bytes(type_name):
    """native/block_repack.c against block_layouts.pack_blocks_reference (numpy), rows that end mid-panel
    and mid-chunk included."""
    for seed, (rows, cols) in enumerate([(40, 512), (1, 256), (1100, 256)]):
        raw = random_blocks(type_name, rows, cols, seed)
        assert np.array_equal(block_layouts.pack_blocks(raw, type_name, rows, cols),
                           block_layouts.pack_blocks_reference(raw, type_name, rows, cols)), (rows, cols)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_0"])
def test_int8_groups_from_blocks_are_the_files_grid(type_name, tmp_path):
    """Q8_0 / Q5_0 / Q4_0 rows repacked as int8 groups (file_linears.int8_groups, stacked with another
    type as a Q8_0 v joins Q5_0 q and k) hold the gguf library's dequantization, the same bytes as the
    grid decoded in numpy (gguf_file.symmetric_grid) and packed in torch."""
    from types import SimpleNamespace

    import gguf

    from kvserve.models import file_linears
    from kvserve.models.gguf_file import GGUFWeights, symmetric_grid
    from kvserve.models.linear import Int8GroupLinear

    rng = np.random.default_rng(5)
    parts = {"a.weight": (type_name, 48), "b.weight": ("Q8_0", 21)}
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for name, (qtype, rows) in parts.items():
        w = (rng.standard_normal((rows, 96)) * 0.1).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, GGMLQuantizationType[qtype]),
                          raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gf = GGUFFile(tmp_path / "t.gguf")
    weights = GGUFWeights(gf, SimpleNamespace(architecture="qwen2"))
    lin = file_linears.int8_groups(weights, list(parts), None)
    expected = torch.cat([gf.load_tensor(n) for n in parts])
    assert torch.equal(lin.weight, expected)
    name, (qtype, rows) = next(iter(parts.items()))
    alone = file_linears.int8_groups(GGUFWeights(gf, SimpleNamespace(architecture="qwen2")), [name], None)
    reference = Int8GroupLinear.from_grid32(rows, 96, symmetric_grid(gf.tensor_bytes(name), rows, 96, qtype))
    assert np.array_equal(alone.packed, reference.packed)


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A GGUF holding each named tensor's raw blocks ([rows, bytes per row]) as the named type."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    for name, (type_name, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("types",
                         [("Q4_K", "Q4_K", "Q6_K"), ("Q5_0", "Q5_0", "Q8_0"), ("Q6_K", "Q8_0", "Q4_K")])
def test_a_stack_of_types_is_held_part_by_part(tmp_path, types):
    """q, k, v of different types (Q4_K_M's Q6_K v, Gemma's Q8_0 v): each run of parts in its own layout
    writing its columns of one output (the kernels' row stride), the columns the same bits as each part
    alone, the weights the file's, the planner's bytes the model's."""
    from types import SimpleNamespace

    from kvserve.models import file_linears
    from kvserve.models.gguf_file import GGUFWeights
    from kvserve.models.linear import Int8GroupLinear, StackedLinear
    from kvserve.plan.model_spec import _from_file_blocks

    cols, rows = 512, (64, 32, 40)
    names = [f"blk.0.attn_{s}.weight" for s in "qkv"]
    tensors = {}
    for i, (name, type_name, n) in enumerate(zip(names, types, rows, strict=True)):
        if type_name == "Q8_0":
            w = np.random.default_rng(i).standard_normal((n, cols)).astype(np.float32)
            raw = gguf_quantize(w, type_name)
        else:
            raw = random_blocks(type_name, n, cols, seed=i).reshape(n, -1)
        tensors[name] = (type_name, raw)
    write_gguf(tmp_path / "m.gguf", tensors)
    gf = GGUFFile(tmp_path / "m.gguf")
    bias = torch.randn(sum(rows))
    lin = file_linears.projection(GGUFWeights(gf, SimpleNamespace(architecture="qwen2")), names, bias, "q4")
    assert isinstance(lin, StackedLinear) and len(lin.parts) == (3 if types[1] != types[0] else 2)
    assert torch.equal(lin.weight, torch.cat([gf.load_tensor(n) for n in names]))
    assert lin.nbytes == _from_file_blocks([gf.tensors[n] for n in names])
    x = torch.randn(5, cols) * torch.linspace(0.1, 10, cols)
    y, first = lin(x), 0
    for part in lin.parts:  # each part alone: the same bits as its columns
        assert torch.equal(part(x).float(), y[:, first : first + part.out_features])
        assert isinstance(part, (Int4Linear, Int8GroupLinear))
        first += part.out_features
    exact = x.double() @ lin.weight.double().T + bias.double()
    assert float((y.double() - exact).norm() / exact.norm()) < 2e-4


def gguf_quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    from gguf.quants import quantize

    return quantize(w, GGMLQuantizationType[type_name])


@pytest.mark.parametrize("layout", ["F16", "Q5_0", "Q6_K"])
def test_a_row_stride_writes_only_its_columns(layout):
    """ldy: a part's output lands in its columns of a wider buffer, the same bits as alone, the other
    columns untouched (int4_matmul in three layouts, int8_matmul's two)."""
    from kvserve.models.linear import _int4_matmul_kernel, _int8_matmul_kernel, _run_matmul
    from kvserve.models.weight_grids import int8_groups, pack_int8_groups
    from tests.native.isa_cases import grid16_inputs, layout_code, layout_inputs

    x, packed, bias = layout_inputs(7, 40, 256, 0, layout)
    alone = _run_matmul(_int4_matmul_kernel(), x, (packed,), bias, 40, (2, layout_code(layout)))
    wide = torch.full((7, 100), 7.0)
    _run_matmul(_int4_matmul_kernel(), x, (packed,), bias, 40, (2, layout_code(layout)), wide[:, 30:70])
    assert torch.equal(wide[:, 30:70], alone)
    assert bool((wide[:, :30] == 7).all() and (wide[:, 70:] == 7).all())
    g32 = pack_int8_groups(*int8_groups(torch.randn(40, 256)))
    _, g16 = grid16_inputs(7, 40, 256, 1)
    for name, w in (("int8_matmul", g32), ("int8_matmul_g16", g16)):
        alone = _run_matmul(_int8_matmul_kernel(name), x, (w,), None, 40)
        _run_matmul(_int8_matmul_kernel(name), x, (w,), None, 40, (), wide[:, 60:])
        assert torch.equal(wide[:, 60:], alone), name


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K"])
def test_q2_k_and_q3_k_from_a_file_are_held_in_their_bits(tmp_path, type_name):
    """A Q2_K / Q3_K tensor of a file becomes a projection in its own layout (once they went through f32,
    rounded to Q8_0's grid at ~3x the file's bytes): the gguf library's weights exactly, the planner's
    bytes the model's, within 4% of the file's."""
    from types import SimpleNamespace

    from kvserve.models import file_linears
    from kvserve.models.gguf_file import GGUFWeights
    from kvserve.plan.model_spec import _from_file_blocks

    rows, cols = 32, 512
    raw = random_blocks(type_name, rows, cols, seed=9).reshape(rows, -1)
    write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (type_name, raw)})
    gf = GGUFFile(tmp_path / "m.gguf")
    lin = file_linears.projection(GGUFWeights(gf, SimpleNamespace(architecture="qwen2")),
                                  ["blk.0.ffn_down.weight"], None, "q4")
    assert isinstance(lin, Int4Linear) and lin.layout == layouts.GGUF_LAYOUTS[type_name][0]
    assert torch.equal(lin.weight, dequantized(raw.reshape(-1), type_name, rows))
    assert lin.nbytes == _from_file_blocks([gf.tensors["blk.0.ffn_down.weight"]]) <= 1.04 * raw.size

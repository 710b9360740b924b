"""The weight formats of ``models.linear``: each row of a batch is computed exactly as it would be
alone, int8 and 4-bit stay within stated error of f32, and q4 takes the 4-bit path only for tensors
that are 4-bit already (the conversion is then exact)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvserve.models.linear import DenseLinear, Int4Linear, Int8GroupLinear, Int8Linear, make_linear
from kvserve.models.weight_grids import INT4_GROUP, int4_groups

CPU = torch.device("cpu")


def four_bit_weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """A weight as a GGUF Q4_1 tensor dequantizes: per group of 32, lo + scale * q with q in 0..15."""
    g = torch.Generator().manual_seed(seed)
    groups = inp // INT4_GROUP
    q = torch.randint(0, 16, (out, groups, INT4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans its full range, as the quantizer makes it
    scale = (torch.rand(out, groups, 1, generator=g) * 0.01 + 1e-3).half().float()  # f16, as Q4_1 stores them
    lo = (-torch.rand(out, groups, 1, generator=g) * 0.1).half().float()
    return (lo + scale * q).view(out, inp)


def formats(weight):
    return {
        fmt: make_linear(weight, None, fmt, CPU, torch.float32) for fmt in (
            "f32", "bf16", "int8", "q4", "q4-fast")}


@pytest.mark.parametrize("fmt", ["int8", "q4", "q4-fast"])
def test_each_row_computed_as_alone(fmt):
    """Integer accumulation with per-row scales (the dense BLAS formats may differ in the last bit
    between a GEMV and a GEMM)."""
    lin = formats(four_bit_weight(256, 192))[fmt]
    x = torch.randn(19, 192, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 30, 192)
    batched = lin(x)
    for i in range(x.shape[0]):
        assert torch.equal(lin(x[i : i + 1])[0], batched[i])
    assert torch.equal(lin(x[3:10]), batched[3:10])


def test_q4_takes_four_bit_tensors_exactly_and_falls_back_to_int8():
    w4 = four_bit_weight(128, 256)
    codes, scale, lo = int4_groups(w4)
    recovered = (lo[..., None] + scale[..., None] * codes.view(128, -1, INT4_GROUP).float()).view(128, 256)
    assert torch.allclose(recovered, w4, rtol=0, atol=1e-6)
    assert isinstance(make_linear(w4, None, "q4", CPU, torch.float32), Int4Linear)
    dense = torch.randn(128, 256)
    assert int4_groups(dense) is None
    tall = four_bit_weight(4200, 64, seed=3)  # two blocks of rows: the codes of both, the check of the second
    codes, scale, lo = int4_groups(tall)
    groups = codes.view(4200, -1, INT4_GROUP).float()
    assert torch.equal((lo[..., None] + scale[..., None] * groups).view(4200, 64), tall)
    tall[4150, 5] += 1e-3
    assert int4_groups(tall) is None
    assert isinstance(make_linear(dense, None, "q4", CPU, torch.float32), Int8GroupLinear)
    assert isinstance(make_linear(dense, None, "f32", CPU, torch.float32), DenseLinear)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0"])
@pytest.mark.parametrize("fmt", ["q4", "int8"])
def test_symmetric_gguf_grids_are_held_exactly(qtype, fmt):
    """A tensor as the gguf library quantizes and dequantizes it: the int8 groups hold each group's own
    f16 scale and codes, the same bits as the library's dequantization (not re-rounded to Q8_0's grid)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    x = torch.randn(96, 320, generator=torch.Generator().manual_seed(4)).numpy()
    x[3, :32] = 0.0  # an all-zero group
    weight = torch.from_numpy(dequantize(quantize(x, GGMLQuantizationType[qtype]),
                                         GGMLQuantizationType[qtype]))
    lin = make_linear(weight, None, fmt, CPU, torch.float32)
    assert isinstance(lin, Int8GroupLinear) and lin.kernel is not None
    assert torch.equal(lin.weight, weight)


def ran_as(lin, fmt: str) -> bool:
    """Whether ``lin`` is the format's own kernel (not a fallback to f32 weights)."""
    if fmt == "bf16":
        return isinstance(lin, DenseLinear) and lin.dtype == torch.bfloat16
    if fmt == "int8":
        return isinstance(lin, Int8GroupLinear) and lin.kernel is not None
    return isinstance(lin,
                      Int4Linear) and lin.kernel is not None and lin.digits == (1 if fmt == "q4-fast" else 2)


@pytest.mark.parametrize("fmt, bound", [("bf16", 0.006), ("int8", 0.006), ("q4", 5e-4), ("q4-fast", 0.02)])
def test_close_to_f32_with_activation_outliers(fmt, bound):
    """Relative error of the output, with a few activation channels 100x the rest (as SmolLM2 has), on a
    4-bit grid's weights. Measured: bf16 0.0028; int8 0.0036 (its weights rounded to Q8_0's grid, the
    two activation digits adding little: as small as bf16's); q4 1.3e-4 (the grid held exactly, only
    the activations' two digits round); q4-fast 0.011 (one digit)."""
    w = four_bit_weight(384, 256, seed=2)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))
    x[:, [5, 77, 200]] *= 100
    lins = formats(w)
    assert ran_as(lins[fmt], fmt)
    ref = lins["f32"](x)
    err = (lins[fmt](x) - ref).norm() / ref.norm()
    assert err < bound


def test_int8_one_digit_would_not_do():
    """Why two activation digits: against the int8 weights themselves, an outlier channel makes one
    digit's rounding error over 100x the two digits'."""
    lin = Int8Linear(torch.randn(256, 256), None)
    x = torch.randn(4, 256)
    x[:, 9] *= 300
    exact = x @ lin.weight.t()
    amax = x.abs().amax(1, keepdim=True)
    one_digit = ((x * 127 / amax).round() * amax / 127) @ lin.weight.t()
    assert (lin(x) - exact).norm() * 100 < (one_digit - exact).norm()


def test_unknown_format_and_bias():
    with pytest.raises(ValueError, match="unknown weight format"):
        make_linear(torch.randn(4, 32), None, "int3", CPU, torch.float32)
    w, b = four_bit_weight(64, 64), torch.randn(64)
    x = torch.randn(3, 64)
    for fmt, lin in ((f, make_linear(w, b, f, CPU, torch.float32)) for f in ("int8", "q4")):
        assert torch.allclose(lin(x), x @ w.t() + b, rtol=0, atol=0.05), fmt


def on_one_thread(fn, x: torch.Tensor) -> torch.Tensor:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn(x)
    finally:
        torch.set_num_threads(threads)


def check_int8_head(head) -> None:
    """Row tiles of eight plus a tail (19 rows with an outlier channel), each row the same bits alone,
    one thread = two; beyond the int8 weights themselves only the activations' int16 codes round
    (~1e-5 of the output)."""
    x = torch.randn(19, head.in_features, generator=torch.Generator().manual_seed(3))
    x *= torch.linspace(0.01, 30, head.in_features)
    x[:, 11] *= 100  # an outlier channel
    batched = head(x)
    for i in range(x.shape[0]):
        assert torch.equal(head(x[i : i + 1])[0], batched[i])
    assert torch.equal(on_one_thread(head, x), batched)
    exact = x.double() @ head.weight.double().T  # exactly the weights the kernel holds
    assert float((batched.double() - exact).norm() / exact.norm()) < 1e-4


def test_int8_head_rows_alone_equal_batched_and_close_to_its_weights():
    """300 outputs, 190 inputs: panels of 16 rows and groups of 32 inputs both padded. The weights are
    rounded to an int8 grid with a scale per group of 32."""
    from kvserve.models.linear import Int8GroupLinear

    weight = torch.randn(300, 190, generator=torch.Generator().manual_seed(2))
    head = make_linear(weight, None, "int8", CPU, torch.float32)
    assert isinstance(head, Int8GroupLinear) and head.kernel is not None
    groups = torch.nn.functional.pad(weight, (0, 2)).view(300, -1, 32).abs().amax(-1)
    step = groups.repeat_interleave(32, 1)[:, :190] / 127  # each weight's own group's step
    assert ((head.weight - weight).abs() <= step / 2 * 1.01 + 1e-7).all()
    check_int8_head(head)


@pytest.mark.parametrize("fmt", ["q4", "q4-fast", "int8"])
def test_a_q8_0_head_is_held_exactly(fmt):
    """GGUF Q8_0 (SmolLM2's output head): int8 codes with an f16 scale per group of 32. Every format's
    head holds such a tensor exactly (one scale per row re-rounded it, which was all of q4's KLD 0.0016
    on SmolLM2)."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (4200, 192), generator=gen).float()  # two blocks of rows as they convert
    codes[:, ::32] = 127  # each group's largest code is 127, as Q8_0's quantizer writes it
    scales = (torch.rand(4200, 6, generator=gen) * 0.02 + 1e-4).half().float()
    weight = codes * scales.repeat_interleave(32, 1)
    head = make_linear(weight, None, fmt, CPU, torch.float32)
    assert torch.equal(head.weight, weight)
    check_int8_head(head)
    ids = torch.tensor([0, 15, 16, 4095, 4096, 4199, 7, 7])  # panel and row-block edges, a repeat
    assert head.holds(weight) and torch.equal(head.rows(ids), weight[ids])  # a tied embedding's lookup
    assert not head.holds(weight + 1e-3) and not make_linear(torch.randn(40, 64), None, fmt, CPU,
                                                             torch.float32).holds(torch.randn(40, 64))


def test_a_tied_q8_0_embedding_is_read_from_the_head(smollm2, smollm2_q4):
    """SmolLM2's tied Q8_0 embedding: the q4 model keeps no f32 table (113 MB), and its rows are the f32
    model's bit for bit, alone and into a buffer (the native decode step's path)."""
    model = smollm2_q4.model
    assert model.embed is None
    ids = torch.tensor([0, 1, 15, 16, 17, 12345, 12345, smollm2.config.vocab_size - 1])
    expected = smollm2.model.embed[ids]
    assert torch.equal(model.embed_tokens(ids), expected)
    out = torch.full((len(ids), smollm2.config.hidden_size), float("nan"))
    assert torch.equal(model.embed_tokens(ids, out=out), expected) and torch.equal(out, expected)


def exact_product(x: torch.Tensor, lin: Int4Linear, w: torch.Tensor) -> torch.Tensor:
    bias = 0 if lin.bias is None else torch.as_tensor(lin.bias).double()
    return (x.double() @ w.double().T + bias).float()


def check_int4_kernel(lin: Int4Linear, w: torch.Tensor, bound: float) -> float:
    """Rows alone = batched across row tiles (6) and row blocks (96), one thread = two; the error
    against the exact product is the activation digits' alone (the weights are exact). Returns it."""
    x = torch.randn(200, w.shape[1], generator=torch.Generator().manual_seed(4)) * torch.linspace(
        0.01, 30, w.shape[1])
    x[:, 7] *= 100  # an outlier channel, as SmolLM2's activations have
    batched = lin(x)
    for i in (0, 5, 6, 95, 96, 101, 199):
        assert torch.equal(lin(x[i : i + 1])[0], batched[i])
    assert torch.equal(lin(x[90:107]), batched[90:107])
    assert torch.equal(on_one_thread(lin, x), batched)
    exact = exact_product(x, lin, w)
    error = float((batched - exact).norm() / exact.norm())
    assert error < bound
    return error


# relative output error of each 4-bit path: q4's two digits, q4-fast's one int8 code per 32-group
INT4_BOUNDS = {"q4": (0, 2e-4), "q4-fast": (1e-3, 2e-2)}


@pytest.mark.parametrize("fmt", ["q4", "q4-fast"])
def test_int4_kernel_rows_invariant_and_exact_up_to_the_activation_digits(fmt):
    """Outputs not a multiple of the 16-wide panel, with a bias (qwen2's q/k/v). q4-fast's error is
    its own, one int8 code per activation (llama.cpp's): between 1e-3 and 2e-2 here."""
    w, b = four_bit_weight(200, 96, seed=5), torch.randn(200)
    lin = make_linear(w, b, fmt, CPU, torch.float32)
    assert isinstance(lin, Int4Linear) and lin.kernel is not None and lin.out_features == 200
    low, high = INT4_BOUNDS[fmt]
    assert check_int4_kernel(lin, w, bound=high) > low


def test_int4_and_int8_kernels_without_avx512(monkeypatch, tmp_path):
    """The portable C loops (what a CPU without AVX-512 VNNI compiles), built here by switching AVX-512
    off."""
    from kvserve import native

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-mno-avx512f"])
    native.load.cache_clear()
    native.function.cache_clear()
    try:
        w, b = four_bit_weight(48, 64, seed=6), torch.randn(48)
        for fmt, (low, high) in INT4_BOUNDS.items():
            lin = make_linear(w, b, fmt, CPU, torch.float32)
            assert lin.kernel is not None and list(tmp_path.rglob("int4_matmul-*.so"))
            assert check_int4_kernel(lin, w, bound=high) > low
        head = make_linear(torch.randn(40, 190), None, "int8", CPU, torch.float32)
        assert head.kernel is not None and list(tmp_path.rglob("int8_matmul-*.so"))
        check_int8_head(head)
    finally:
        native.load.cache_clear()
        native.function.cache_clear()


def test_int4_without_the_kernel_uses_torchs(monkeypatch):
    from kvserve.models import linear

    monkeypatch.setattr(linear, "_int4_matmul_kernel", lambda: None)
    w = four_bit_weight(64, 64, seed=7)
    lin = make_linear(w, None, "q4", CPU, torch.float32)
    assert lin.kernel is None and lin.scales_zeros.dtype == torch.bfloat16
    x = torch.randn(5, 64)
    exact = exact_product(x, lin, w)
    assert float((lin(x).float() - exact).norm() / exact.norm()) < 0.01  # bf16 activations


def test_a_models_packed_weights_live_in_one_arena(smollm2_q4):
    """Every 4-bit projection and the int8 head (packed straight from the file's Q8_0 blocks) of the loaded
    model: views of one region, packed in place (``host_memory.PackingArena``, 2 MiB pages on Linux), not
    copied there after."""
    import sys

    from kvserve.host_memory import HUGE_PAGE
    from kvserve.models.linear import Int8GroupLinear

    model = smollm2_q4.model
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(lin, Int4Linear) for lin in linears) and isinstance(model.lm_head, Int8GroupLinear)
    def buffer_of(a):  # the memory a numpy view was cut from (the arena's mapping)
        while isinstance(a.base, np.ndarray):
            a = a.base
        return id(a.base)

    packed = [model.lm_head.packed] + [lin.packed for lin in linears]
    assert len({buffer_of(a) for a in packed}) == 1  # (ids: a failing assert must not print the region)
    ends = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in packed)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(ends))  # disjoint
    if sys.platform.startswith("linux"):
        assert ends[0][0] % HUGE_PAGE == 0

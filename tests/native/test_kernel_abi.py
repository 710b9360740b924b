"""One declaration of each native function (native/kernels.h), and everything that calls one held to it:
the C definitions (each source includes the header), the libraries' exports, the ctypes signatures of
the Python side (native/abi.py reads the header), model_step.c's calls and the operation words
native/step_ops.py writes for them. Each check is also shown failing on a deliberate mismatch."""

from __future__ import annotations

import ctypes
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from kvserve import native
from kvserve.attention import native_paged
from kvserve.config import ModelConfig
from kvserve.kv.storage import PagedKVStorage
from kvserve.models import activations, linear, native_step, norms, rope
from kvserve.native import abi, step_ops

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")

SOURCES = sorted(p.stem for p in native.SOURCE_DIR.glob("*.c"))
LINKER_SYMBOLS = {"_init", "_fini", "__bss_start", "_edata", "_end"}


def exported(library: Path) -> set[str]:
    """The names a shared library defines in its dynamic symbol table."""
    if shutil.which("nm") is None:
        pytest.skip("not run: no nm on this machine (Debian: binutils)")
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], check=True, capture_output=True,
                         text=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()} - LINKER_SYMBOLS


def build_with_header(name: str, header: str, where: Path) -> subprocess.CompletedProcess:
    """``<name>.c`` built as its library is, beside ``header`` as its kernels.h (the other headers it
    includes are the directory's)."""
    shutil.copy(native.SOURCE_DIR / f"{name}.c", where / f"{name}.c")
    (where / "kernels.h").write_text(header)
    return subprocess.run([native.compiler(), *native.build_flags(name), f"-I{native.SOURCE_DIR}",
                           str(where / f"{name}.c"), "-o", str(where / f"{name}.so")],
                          capture_output=True, text=True, timeout=300, check=False)


# --- the C side ---------------------------------------------------------------------------------------


def test_every_source_includes_the_header():
    """So the compiler checks each definition against its declaration."""
    for name in SOURCES:
        assert '#include "kernels.h"' in (native.SOURCE_DIR / f"{name}.c").read_text(), name


@pytest.mark.parametrize("name", SOURCES)
def test_every_export_is_declared_in_its_section(name):
    """A library exports exactly the functions kernels.h declares under its name (and simd_isa, which
    every library built against simd.h exports)."""
    library = native.load(name)
    assert library is not None, f"{name}.c did not build"
    declared = {p.name for p in abi.header().prototypes.values() if p.source == name}
    assert declared, f"kernels.h has no section for {name}.c"
    assert exported(Path(library._name)) - {"simd_isa"} == declared


def test_every_prototype_names_a_source():
    for proto in abi.header().prototypes.values():
        assert proto.source in (*SOURCES, None), proto
        assert proto.source is not None or proto.name == "simd_isa"


def test_a_definition_that_disagrees_with_the_header_does_not_compile(tmp_path):
    header = (native.SOURCE_DIR / "kernels.h").read_text()
    assert build_with_header("rms_norm", header, tmp_path).returncode == 0
    wrong = header.replace("float eps, int n, int hidden, float *out);",
                           "float eps, int n, int64_t hidden, float *out);")
    assert wrong != header
    built = build_with_header("rms_norm", wrong, tmp_path)
    assert built.returncode != 0 and "conflicting types for" in built.stderr and "rms_norm" in built.stderr


def test_a_step_call_that_disagrees_with_the_header_does_not_compile(tmp_path):
    """model_step.c calls each kernel through the header's type: an integer word passed where the
    header now says pointer is an error (its #pragma), not a silent conversion."""
    header = (native.SOURCE_DIR / "kernels.h").read_text()
    assert build_with_header("model_step", header, tmp_path).returncode == 0
    wrong = header.replace("void rope_in_place(float *x, int tokens, int heads,",
                           "void rope_in_place(float *x, int tokens, const float *heads,")
    assert wrong != header
    built = build_with_header("model_step", wrong, tmp_path)
    assert built.returncode != 0 and "int-conversion" in built.stderr


# --- the Python side ----------------------------------------------------------------------------------


def python_bindings() -> dict[str, object]:
    """Every native function the package calls through ctypes, as it binds it."""
    storage = PagedKVStorage(ModelConfig(architecture="llama", num_layers=1, hidden_size=64,
                                         intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=32,
                                         vocab_size=8, max_position_embeddings=64),
                             4, 16, "f32", torch.device("cpu"))
    attention, writer = native_paged.for_storage(storage), native_paged.writer_for_storage(storage)
    return {
        "rms_norm": norms._rms_norm_kernel(), "add_rms_norm": norms._add_rms_norm_kernel(),
        "rms_norm_heads": norms._rms_norm_heads_kernel(),
        "silu_mul": activations.gate_kernel("silu"), "gelu_tanh_mul": activations.gate_kernel("gelu_tanh"),
        "rope_in_place": rope._kernel(),
        "int4_matmul": linear._int4_matmul_kernel(),
        "int8_matmul": linear._int8_matmul_kernel("int8_matmul"),
        "int8_matmul_g16": linear._int8_matmul_kernel("int8_matmul_g16"),
        "int8_rows": linear._int8_rows_kernel("int8_rows"),
        "int8_rows_g16": linear._int8_rows_kernel("int8_rows_g16"),
        "paged_decode_attention": attention.decode_kernel,
        "paged_prefill_attention": attention.prefill_kernel, "kv_write": writer.kernel,
        "model_step": native_step._step_function(),
    }


def test_every_python_signature_is_the_headers():
    for name, fn in python_bindings().items():
        assert fn is not None, f"{name} not built"
        proto = abi.prototype(name)
        assert (fn.argtypes, fn.restype) == (proto.argtypes, proto.ctypes_restype), name


def test_no_module_writes_a_kernel_signature_by_hand():
    """Signatures of this package's kernels come from abi.py only (the libc calls elsewhere are not ours)."""
    package = Path(native.__file__).parents[1]
    for path in package.rglob("*.py"):
        text = path.read_text()
        if path.name != "abi.py" and re.search(r"\.argtypes\b[^=\n]*=(?!=)", text):
            assert "kvserve.native" not in text and "from kvserve import native" not in text, path


def test_a_hand_written_signature_that_disagrees_raises():
    p, i = ctypes.c_void_p, ctypes.c_int
    # as bench writes
    assert native.function("rms_norm", "rms_norm", (p, p, ctypes.c_float, i, i, p)) is not None
    with pytest.raises(TypeError, match=r"rms_norm: ctypes signature .* disagrees with kernels.h's"):
        native.function("rms_norm", "rms_norm", (p, p, i, i, i, p))
    with pytest.raises(TypeError, match="int4_matmul"):
        # its int result left out
        native.function("int4_matmul", "int4_matmul", (p, p, p, i, i, i, p, i, i, i, i))
    with pytest.raises(LookupError, match="no_such_kernel: no prototype in native/kernels.h"):
        native.function("rms_norm", "no_such_kernel")


def test_the_parser_reads_only_its_form():
    header = abi.parse("/* probe.c: a section */\n#define WORDS 4\nenum { A = 1, B = 2, };\n"
                       "int probe(const float *x, int64_t n, float s, uint8_t *out);\nvoid none(void);\n")
    assert header.constants == {"WORDS": 4, "A": 1, "B": 2}
    probe = header.prototypes["probe"]
    assert probe.source == "probe" and [p.name for p in probe.params] == ["x", "n", "s", "out"]
    assert probe.argtypes == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    assert probe.ctypes_restype is ctypes.c_int and header.prototypes["none"].argtypes == []
    for bad, message in (("void f(double x);", "type 'double'"), ("void f(int);", "a type and a name"),
                         ("void f(size_t n);", "type 'size_t'"), ("typedef int word;", "not a prototype"),
                         ("void f(int x);\nvoid f(int x);", "declared twice"),
                         ("enum { A };", "enum entries")):
        with pytest.raises(ValueError, match=message):
            abi.parse(bad)


# --- the step's operations ---------------------------------------------------------------------------


def probe_source() -> str:
    """Stand-ins for the functions an operation calls, generated from kernels.h (and compiled against it,
    which checks the parser too): each records which it is and every argument it got, as int64 words."""
    put = {ctypes.c_void_p: "put((int64_t)(intptr_t){})", ctypes.c_int: "put({})", ctypes.c_int64: "put({})",
           ctypes.c_float: "put_float({})"}
    lines = ['#include <string.h>', '#include "kernels.h"', "int64_t probe_log[64][32];", "int probe_calls;",
             "static int64_t *row; static int at;",
             "static void put(int64_t v) { row[at++] = v; }",
             "static void put_float(float f) { double d = f; int64_t w; memcpy(&w, &d, 8); put(w); }"]
    for number, name in enumerate(step_ops.STEP_ARGS):
        proto = abi.prototype(name)
        params = ", ".join(f"{p.type}{'' if p.type.endswith('*') else ' '}{p.name}" for p in proto.params)
        body = [f"row = probe_log[probe_calls++]; at = 0; put({number});"]
        body += [put[abi.ctype(p.type)].format(p.name) + ";" for p in proto.params]
        body += ["return 0;"] if proto.restype == "int" else []
        lines.append(f"{proto.restype} {name}({params}) {{ {' '.join(body)} }}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    out = tmp_path_factory.mktemp("probes")
    (out / "probes.c").write_text(probe_source())
    subprocess.run([native.compiler(), "-O1", "-fPIC", "-shared", f"-I{native.SOURCE_DIR}",
                    str(out / "probes.c"), "-o", str(out / "probes.so")], check=True, capture_output=True,
                    text=True, timeout=120)
    return ctypes.CDLL(str(out / "probes.so"))


def sentinel(c_type: str, index: int) -> int | float:
    """A value for parameter ``index`` that no other parameter gets and that shows a wrong width or kind."""
    kind = abi.ctype(c_type)
    return {ctypes.c_void_p: 0x10000 + 16 * index, ctypes.c_int: 1000 + 7 * index,
            ctypes.c_int64: (1 << 40) + index, ctypes.c_float: 0.25 + index}[kind]


STEP = {"n": 3, "block_tables": 0xB000, "table_stride": (1 << 41) + 5, "context_lens": 0xC000,
        "slot_rows": 0xD000, "sequence_tables": 0xE000, "decodes": 2, "sequence_rows": 5,
        "sequence_position": (1 << 40) + 7}


def run_operations(probes, ops: list[list[int]]) -> list[list[int]]:
    """The words model_step.c passed to each stand-in, in call order ([which, arguments...]), for a batch of
    STEP["decodes"] decodes and one prefill chunk (from row 0, its block table first in sequence_tables)."""
    ctypes.c_int.in_dll(probes, "probe_calls").value = 0
    step = native.function("model_step", "model_step")
    table = torch.tensor(ops, dtype=torch.int64)
    constants = abi.header().constants
    batch = torch.zeros(constants["BATCH_HEADER"] + STEP["decodes"] + constants["BATCH_SEQUENCE_WORDS"],
                        dtype=torch.int64)
    batch[constants["BATCH_DECODES"]], batch[constants["BATCH_SEQUENCES"]] = STEP["decodes"], 1
    batch[constants["BATCH_TABLE_WORDS"]] = 9
    batch[-4:] = torch.tensor([0, STEP["sequence_rows"], STEP["sequence_position"], 0])
    STEP["decode_rows"] = batch.data_ptr() + 8 * constants["BATCH_HEADER"]
    assert step(table.data_ptr(), len(ops), STEP["n"], batch.data_ptr(), STEP["block_tables"],
                STEP["table_stride"], STEP["context_lens"], STEP["slot_rows"], STEP["sequence_tables"]) == 0
    log = (ctypes.c_int64 * 32 * 64).in_dll(probes, "probe_log")
    return [list(log[c]) for c in range(ctypes.c_int.in_dll(probes, "probe_calls").value)]


def expected_words(name: str, args: dict) -> list[int]:
    proto, step = abi.prototype(name), step_ops.STEP_ARGS[name]
    words = [list(step_ops.STEP_ARGS).index(name)]
    for p in proto.params:
        value = STEP[step[p.name]] if p.name in step else args[p.name]
        float_type = abi.ctype(p.type) is ctypes.c_float
        words.append(struct.unpack("<q", struct.pack("<d", value))[0] if float_type else value)
    return words


def layout_mismatches(probes, corrupt=lambda name, words: words) -> list[str]:
    """Each function's operation as step_ops writes it, run by model_step.c against the stand-ins:
    the parameters (by name) whose argument was not the value given for it."""
    names = list(step_ops.STEP_ARGS)
    args = {name: {p.name: sentinel(p.type, i) for i, p in enumerate(abi.prototype(name).params)
                   if p.name not in step_ops.STEP_ARGS[name]} for name in names}
    ops = [corrupt(name, step_ops.operation(name, ctypes.cast(getattr(probes, name), ctypes.c_void_p).value,
                                              **args[name])) for name in names]
    calls = run_operations(probes, ops)
    assert len(calls) == len(names)
    wrong = []
    for name, got in zip(names, calls, strict=True):
        want = expected_words(name, args[name])
        params = ["(which function)", *(p.name for p in abi.prototype(name).params)]
        wrong += [f"{name}.{params[i]}" for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
    return wrong


def test_model_step_passes_each_parameter_the_word_step_ops_wrote(probes):
    assert layout_mismatches(probes) == []


def test_a_wrong_operation_layout_is_caught(probes):
    """Two words of one operation swapped (as a layout written by hand in a wrong order would be)."""
    def swap_n_and_k(name, words):
        if name == "int4_matmul":
            words[2 + 4], words[2 + 5] = words[2 + 5], words[2 + 4]
        return words

    assert layout_mismatches(probes, swap_n_and_k) == ["int4_matmul.N", "int4_matmul.K"]


def test_an_operation_names_every_parameter_the_header_has():
    address = 0x1000
    with pytest.raises(TypeError, match=r"missing \['out'\], not parameters \['output'\]"):
        step_ops.operation("silu_mul", address, gate_up=1, inter=2, output=3)
    with pytest.raises(ValueError, match="inter=4294967296 does not fit int"):
        step_ops.operation("silu_mul", address, gate_up=1, inter=1 << 32, out=3)
    words = step_ops.operation("silu_mul", address, gate_up=1, inter=2, out=3)
    assert words[:6] == [abi.header().constants["OP_SILU_MUL"], address, 1, 0, 2, 3]
    assert len(words) == abi.header().constants["OP_FIELDS"]


def test_every_operation_kind_is_declared():
    for name, step in step_ops.STEP_ARGS.items():
        assert f"OP_{name.upper()}" in abi.header().constants, name
        assert set(step) <= {p.name for p in abi.prototype(name).params}, name
        taken = {p.name for p in abi.prototype("model_step").params} | set(step_ops.BATCH_PARTS)
        assert set(step.values()) <= taken, name

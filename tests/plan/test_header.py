"""The GGUF header reader against the `gguf` library's full reader, on the real SmolLM2 file
and on small files written with ``gguf.GGUFWriter``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvserve.errors import ModelLoadError
from kvserve.models.gguf_config import read_model_config
from kvserve.models.gguf_header import MAX_DECODED_STRINGS, SkippedArray, read_gguf_header
from kvserve.plan.presets import num_params


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    import gguf

    return gguf.GGUFReader(str(smollm2_path)), read_gguf_header(smollm2_path)  # the library's reader: seconds


def config_from_header(header):
    return read_model_config(header)


def test_metadata_equals_gguf_reader(smollm2):
    reader, header = smollm2
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(header.metadata) == keys
    for key in keys:
        ours, theirs = header.metadata[key], reader.fields[key].contents()
        if isinstance(ours, SkippedArray):  # long arrays are stepped over: only their length is kept
            assert len(ours) == len(theirs) > MAX_DECODED_STRINGS, key
        else:
            assert ours == theirs, key
    assert len(header.get("tokenizer.ggml.tokens")) == 49152


def test_decoded_arrays_equal_gguf_reader(smollm2, smollm2_path):
    reader, _ = smollm2
    full = read_gguf_header(smollm2_path, decode_arrays=True)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        assert list(full.get(key)) == reader.fields[key].contents(), key  # lists, or kept as bytes or packed


def test_loader_tensors_equal_gguf_reader_dequantization(smollm2, smollm2_path):
    """The loader reads tensor bytes through the header's offsets; the library reads them its own way."""
    from gguf.quants import dequantize

    from kvserve.models.gguf_file import GGUFFile

    reader, _ = smollm2
    gf = GGUFFile(smollm2_path)
    by_type = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, t)
    assert set(by_type) == {"Q4_1", "Q8_0", "F32"}
    for t in by_type.values():
        expected = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        assert np.array_equal(gf.load_tensor(t.name).numpy(), expected), t.name


def test_tensor_infos_equal_gguf_reader(smollm2):
    reader, header = smollm2
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = header.tensors[t.name]
        assert info.dims == tuple(int(d) for d in t.shape)
        assert info.type_name == t.tensor_type.name
        assert info.num_elements == int(t.n_elements)
        assert info.num_bytes == int(t.n_bytes)
        assert header.data_offset + info.offset == int(t.data_offset)
    assert header.bytes_by_type() == {"Q4_1": 66355200, "Q8_0": 30081024, "F32": 140544}


def test_smollm2_parameters_match_the_formula(smollm2):
    _, header = smollm2
    assert header.num_params == num_params(config_from_header(header)) == 134_515_008


@pytest.fixture(scope="module")
def gemma_entry():
    from kvserve.models.registry import REGISTRY, installed_path

    entry = REGISTRY["gemma3-270m"]
    assert installed_path(entry, assemble=False) is not None, "run: kvserve pull gemma3-270m (make test does)"
    return entry


def test_gemma3_270m_header_has_the_published_config(gemma_entry):
    import importlib

    chunks = importlib.import_module(gemma_entry.module).chunk_paths()
    header = read_gguf_header(chunks)  # the header of the chunks, as if concatenated: nothing assembled
    c = config_from_header(header)
    assert (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.max_position_embeddings,
        c.sliding_window,
    ) == (18, 640, 2048, 4, 1, 256, 262144, 32768, 512)
    assert [i for i, s in enumerate(c.sliding_window_layers) if not s] == [5, 11, 17]
    assert header.num_params == num_params(c) == 268_098_176


def _write(path, endianess=None, num_tokens=5000, kv_heads=(2, 4)):
    import gguf

    kwargs = {"endianess": endianess} if endianess is not None else {}
    w = gguf.GGUFWriter(str(path), "llama", **kwargs)
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(list(kv_heads))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(num_tokens)])
    w.add_token_scores([float(i) for i in range(num_tokens)])
    w.add_array("test.small_strings", ["a", "bc"])
    w.add_tensor("token_embd.weight", np.ones((num_tokens, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_written_file_reads_back(tmp_path):
    h = read_gguf_header(_write(tmp_path / "tiny.gguf"))
    assert h.get("general.name") == "tiny" and h.get("llama.attention.head_count_kv") == [2, 4]
    assert h.get("test.small_strings") == ["a", "bc"]
    assert h.get("tokenizer.ggml.tokens") == SkippedArray("STRING", 5000)
    assert h.get("tokenizer.ggml.scores") == SkippedArray("FLOAT32", 5000)
    assert h.tensors["token_embd.weight"].dims == (32, 5000)
    assert h.num_weight_bytes == (5000 * 32 + 32) * 4
    c = config_from_header(h)
    assert (c.num_kv_heads, c.vocab_size, c.head_dim, c.tie_word_embeddings) == (4, 5000, 8, True)


def test_big_endian_file_reads_the_same(tmp_path):
    from gguf.constants import GGUFEndian

    little = read_gguf_header(_write(tmp_path / "le.gguf"))
    big = read_gguf_header(_write(tmp_path / "be.gguf", GGUFEndian.BIG))
    assert big.metadata == little.metadata and big.tensors == little.tensors


def test_chunks_read_as_one_file(tmp_path):
    data = _write(tmp_path / "whole.gguf").read_bytes()
    cuts = [0, 7, 1000, 25000, len(data)]  # chunk boundaries inside the magic, a string array, the data
    chunks = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        chunks.append(tmp_path / f"part{i}")
        chunks[-1].write_bytes(data[a:b])
    assert read_gguf_header(chunks).metadata == read_gguf_header(tmp_path / "whole.gguf").metadata


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "notes.gguf"
    f.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf_header(f)


@pytest.mark.parametrize(
    "keep, message", [(1_000, "truncated"), (300_000, "truncated"), (2_000_000, "truncated GGUF file")]
)
def test_truncated_files(smollm2_path, tmp_path, keep, message):
    f = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        f.write_bytes(src.read(keep))
    with pytest.raises(ModelLoadError, match=message):
        read_gguf_header(f)


def test_absurd_array_length_is_malformed_not_a_hang(tmp_path):
    data = bytearray(_write(tmp_path / "tiny.gguf").read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key) + 4 + 4  # past the value type (array) and the element type (string)
    data[at : at + 8] = (1 << 60).to_bytes(8, "little")
    f = tmp_path / "bad.gguf"
    f.write_bytes(data)
    with pytest.raises(ModelLoadError, match="malformed"):
        read_gguf_header(f)


def _strings_file(path, strings, endianess=None):
    import gguf

    kwargs = {"endianess": endianess} if endianess is not None else {}
    w = gguf.GGUFWriter(str(path), "llama", **kwargs)
    w.add_array("tokenizer.ggml.tokens", strings)
    w.add_array("test.scores", [-i / 4 for i in range(len(strings))])  # long: an array.array of f32
    w.add_array("test.after", [1, 2, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("big_endian", [False, True])
@pytest.mark.parametrize("read_size", [64, 4 << 20])
def test_native_string_walk_decodes_as_the_python_loop(tmp_path, monkeypatch, big_endian, read_size):
    """gguf_string_spans (buffer after buffer, strings cut by the buffer's end) and the gathered decode
    give the Python loop's strings: empty ones, a NUL inside one, long ones, odd UTF-8."""
    from gguf.constants import GGUFEndian

    from kvserve.models import gguf_header

    if gguf_header._string_spans() is None:
        pytest.skip("not run: no kernel library on this machine")
    strings = [f"tok{i}" + "é" * (i % 5) for i in range(6000)]
    strings[10], strings[11], strings[4000] = "", "x" * 300, "ünï\ncode 🙂"
    path = _strings_file(tmp_path / "s.gguf", strings, GGUFEndian.BIG if big_endian else None)
    monkeypatch.setattr(gguf_header, "_READ_SIZE", read_size)
    native = read_gguf_header(path, decode_arrays=True)
    skipped = read_gguf_header(path)
    monkeypatch.setattr(gguf_header, "_string_spans", lambda: None)
    python = read_gguf_header(path, decode_arrays=True)
    assert native.metadata == python.metadata and native.get("tokenizer.ggml.tokens") == strings
    kept = native.get("tokenizer.ggml.tokens")  # the strings' bytes, read like the list
    assert isinstance(kept, gguf_header.StringArray) and isinstance(python.get("tokenizer.ggml.tokens"), list)
    assert len(kept) == len(strings) and list(kept) == strings and kept.tolist() == strings
    assert [kept[i] for i in (0, 10, 11, 4000, -1)] == [strings[i] for i in (0, 10, 11, 4000, -1)]
    assert kept[5:9] == strings[5:9] and kept != strings[:-1] and kept != [*strings[:-1], "other"]
    assert skipped.get("test.after") == [1, 2, 3]
    scores = native.get("test.scores")  # in the file's byte order, read back as this machine's floats
    assert scores.itemsize == 4 and list(scores) == [-i / 4 for i in range(len(strings))] and scores[-1] < 0
    original = path.read_bytes()
    for name, marks in (("broken UTF-8", [0xE2, 0x82]), ("a NUL inside", [0, 0xE2])):
        data = bytearray(original)
        at = data.index(b"tok5") + 1  # strings[5]
        data[at : at + 2] = bytes(marks)
        data[data.index(b"tok7") + 3] = 0xF0  # strings[7]: a 4-byte sequence cut short by its end
        path.write_bytes(bytes(data))
        monkeypatch.setattr(gguf_header, "_string_spans", lambda: None)
        python = read_gguf_header(path, decode_arrays=True).get("tokenizer.ggml.tokens")
        monkeypatch.undo()
        monkeypatch.setattr(gguf_header, "_READ_SIZE", read_size)
        kept = read_gguf_header(path, decode_arrays=True).get("tokenizer.ggml.tokens")
        assert kept == python and [kept[5], kept[7]] == [python[5], python[7]], name
        assert "\ufffd" in python[5] and "\ufffd" in python[7] and ("\0" in python[5]) == (marks[0] == 0)


def test_native_string_walk_stops_at_a_truncated_array(tmp_path):
    from kvserve.models import gguf_header

    if gguf_header._string_spans() is None:
        pytest.skip("not run: no kernel library on this machine")
    data = _strings_file(tmp_path / "s.gguf", [f"t{i}" for i in range(9000)]).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"t8000")])
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf_header(cut)

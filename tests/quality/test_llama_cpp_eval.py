"""`kvserve eval --compare llama.cpp`: llama-perplexity's logits file and summary read right, and both
engines scored on the same tokens and positions (a stand-in tool here; the real one is `make llama-cpp`'s)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from kvserve.quality.llama_cpp import PeerToolError, parse_kld_output, read_logits_tokens

SUMMARY = """\
====== Perplexity statistics ======
Mean PPL(Q)                   :  12.345678 ±   0.321000
Mean PPL(base)                :  12.000000 ±   0.300000
Cor(ln(PPL(Q)), ln(PPL(base))):  99.10%
Mean ln(PPL(Q)/PPL(base))     :   0.028395 ±   0.001000

====== KL divergence statistics ======
Mean    KLD:   0.051234 ±   0.001200
Maximum KLD:   2.500000
Median  KLD:   0.020000

====== Token probability statistics ======
Mean    Δp: -0.512 ± 0.040 %
RMS Δp    :  5.123 ± 0.101 %
Same top p: 87.912 ± 0.512 %
"""


def test_parse_kld_output():
    q = parse_kld_output("llama_context: n_ctx = 1024\n" + SUMMARY)
    assert (q.kld, q.top1_agreement, q.ppl, q.base_ppl) == (0.051234, 87.912, 12.345678, 12.0)
    with pytest.raises(PeerToolError, match="kld"):
        parse_kld_output(SUMMARY.replace("Mean    KLD", "Mean KL"))


def _logits_file(path, n_ctx, n_chunk, magic=b"_logits_"):
    tokens = [(7 * i) % 500 + 10 for i in range(n_ctx * n_chunk)]
    head = magic + struct.pack("<Iii", n_ctx, 49152, n_chunk)
    path.write_bytes(head + struct.pack(f"<{len(tokens)}i", *tokens) + b"\0" * 64)  # log-probs follow
    return tokens


def test_read_logits_tokens(tmp_path):
    f = tmp_path / "base.kld"
    tokens = _logits_file(f, 8, 3)
    assert read_logits_tokens(f) == (8, [tokens[:8], tokens[8:16], tokens[16:]])
    _logits_file(f, 8, 1, magic=b"_logitz_")
    with pytest.raises(ValueError, match="not a llama-perplexity"):
        read_logits_tokens(f)
    f.write_bytes(b"_logits_" + struct.pack("<Iii", 8, 10, 3) + b"\0" * 20)
    with pytest.raises(ValueError, match="truncated"):
        read_logits_tokens(f)


FAKE_TOOL = '''#!{python}
"""Stand-in llama-perplexity: the reference run writes a logits file of known tokens; a --kl-divergence
run prints a summary whose KLD names the K type. Every call is logged."""
import json, struct, sys
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if "--kl-divergence" not in args:
    n_ctx, chunks = int(opt("-c")), int(opt("--chunks"))
    tokens = [(7 * i) % 400 + 30 for i in range(n_ctx * chunks)]
    with open(opt("--kl-divergence-base"), "wb") as f:
        f.write(b"_logits_" + struct.pack("<Iii", n_ctx, 49152, chunks))
        f.write(struct.pack(f"<{{len(tokens)}}i", *tokens))
else:
    kld = {{"f32": 0.00001, "q8_0": 0.004, "q4_0": 0.05, "q4_1": 0.045}}[opt("-ctk")]
    print({summary!r}.replace("0.051234", f"{{kld:.6f}}"))
'''


@pytest.mark.slow
def test_compare_llama_cpp_rows_beside_ours(tmp_path):
    log = tmp_path / "calls.jsonl"
    tool = tmp_path / "llama-perplexity"
    tool.write_text(FAKE_TOOL.format(python=sys.executable, log=str(log), summary=SUMMARY))
    tool.chmod(0o755)
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, "-m", "kvserve", "eval", "smollm2", "--ctx", "256", "--windows", "2",
         "--cache-types", "q8_0,q4_0,tq4,q4_1", "--needle-lengths", "none", "--compare", "llama.cpp",
         "--threads", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "KVSERVE_LLAMA_CPP_BIN": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    ours = {row["cache_type_k"]: row for row in rows if row["engine"] == "kvserve"}
    peer = {row["cache_type_k"]: row for row in rows if row["engine"] == "llama.cpp"}
    assert set(ours) == {"f32", "q8_0", "q4_0", "tq4"}
    assert set(peer) == {"f32", "q8_0", "q4_0", "q4_1"}  # llama.cpp has no tq4, we have no q4_1
    assert [peer[t]["kld"] for t in ("f32", "q8_0", "q4_0", "q4_1")] == [0.00001, 0.004, 0.05, 0.045]
    assert peer["q4_0"]["bits_per_element"] == 4.5 and peer["q4_0"]["delta_ppl"] == pytest.approx(0.345678)
    assert len(ours["q4_0"]["top1_by_window"]) == 2 and 0 < ours["q8_0"]["kld"] < ours["q4_0"]["kld"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    reference, *measured = calls
    assert reference[reference.index("-ctk") + 1] == "f32"
    assert reference[reference.index("--chunks") + 1] == "2"
    assert all(c[c.index("-fa") + 1] == "on" and c[c.index("-c") + 1] == "256" for c in calls)
    assert [c[c.index("-ctv") + 1] for c in measured] == ["f32", "q8_0", "q4_0", "q4_1"]
    assert "llama.cpp" in r.stdout and "second half" in r.stdout


@pytest.mark.parametrize("args, stand_in, message", [
    (["--compare", "llama.cpp"], False, "make llama-cpp"),  # no llama-perplexity where it looks
    (["--compare", "llama.cpp", "--cache-types", "q4_1,q9_9"], True, "neither kvserve nor llama.cpp has it"),
    (["--cache-types", "q4_1"], False, "unknown KV cache type 'q4_1'"),  # a llama.cpp type needs --compare
    (["--compare", "llama.cpp", "--cache-types", "q4_0"], True, "llama-perplexity failed: no such thing"),
])
def test_compare_errors(tmp_path, args, stand_in, message):
    if stand_in:  # a llama-perplexity that fails (the q9_9 case must stop before it)
        (tmp_path / "llama-perplexity").write_text("#!/bin/sh\necho no such thing >&2\nexit 3\n")
        (tmp_path / "llama-perplexity").chmod(0o755)
    r = subprocess.run(
        [sys.executable, "-m", "kvserve", "eval", "smollm2", "--ctx", "256", "--needle-lengths", "none",
         *args],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
        env={**os.environ, "KVSERVE_LLAMA_CPP_BIN": str(tmp_path)},
    )
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr

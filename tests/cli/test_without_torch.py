"""The CPU runtime needs no torch: ``kvserve run`` of each model we ship answers in a process where torch
cannot be imported (as on an install without it), with the text a process that has torch gives; with
quantized KV too (rotated, centred and balanced keys; a rotated low-bit codebook)."""

from __future__ import annotations

import subprocess
import sys

import pytest

RUNS = [("smollm2", []), ("gemma3-270m", []), ("qwen2.5-coder-0.5b", []),
        ("qwen2.5-coder-0.5b", ["--cache-type", "q8_0"]), ("gemma3-270m", ["-ctk", "q4_0", "-ctv", "tq3"])]
# None in sys.modules makes every `import torch` raise ImportError, as on a machine without it
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def kvserve(args: list[str], without_torch: bool) -> subprocess.CompletedProcess:
    code = (NO_TORCH if without_torch else "") + (
        "import runpy, sys\n"
        f"sys.argv = ['kvserve', *{args!r}]\n"
        "try:\n"
        "    runpy.run_module('kvserve', run_name='__main__')\n"
        "finally:\n"
        "    print('torch imported:', sys.modules.get('torch') is not None, file=sys.stderr)\n")
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("model, kv", RUNS)
def test_run_answers_without_torch(model, kv):
    args = ["run", model, "Write a haiku about the sea.", "-n", "12", "--temperature", "0", *kv]
    alone = kvserve(args, without_torch=True)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "torch imported: False" in alone.stderr
    assert alone.stdout.strip()
    beside = kvserve(args, without_torch=False)
    assert beside.returncode == 0, beside.stderr[-3000:]
    assert "torch imported: False" in beside.stderr  # nothing on the path asks for it even when it is there
    assert alone.stdout == beside.stdout


@pytest.mark.parametrize("args", [["eval", "smollm2", "--ctx", "64"],
                                  ["serve", "smollm2", "--embedding-model", "all-minilm", "--port", "1"]])
def test_what_needs_torch_says_so_without_it(args):
    """The torch backend's features fail with one line that says how to get it, not a traceback."""
    done = kvserve(args, without_torch=True)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "error: this needs torch" in done.stderr and "pip install 'kvserve[torch]'" in done.stderr
    assert "Traceback" not in done.stderr

"""Commands that only print or read a header start without the engine, the server or torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "fastapi", "uvicorn", "transformers", "tokenizers", "kvserve.engine.engine",
         "kvserve.server.app", "kvserve.models.decoder")

PROBE = """
import contextlib, io, json, sys
from kvserve.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:  # --help
        code = e.code
print(json.dumps([code, [m for m in {heavy!r} if m in sys.modules]]))
"""


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["serve", "--help"], ["list"],
                                  ["pull", "--help"], ["plan", "--help"], ["plan", "Llama-3.1-8B"],
                                  ["doctor", "--json"]])
def test_command_imports_nothing_heavy(argv):
    probe = PROBE.format(heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe, *argv], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    code, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0
    assert heavy == []


def test_package_names_still_resolve():
    import kvserve

    assert kvserve.SamplingParams(max_tokens=3).max_tokens == 3
    assert kvserve.RequestOutput.__name__ == "RequestOutput"
    with pytest.raises(AttributeError):
        _ = kvserve.no_such_name


def test_the_sampler_and_a_request_need_no_torch():
    """The CPU runtime's pieces that are torch-free already stay so (issue: no torch on the CPU path)."""
    probe = ("import sys, kvserve.engine.sampler, kvserve.engine.request, kvserve.kv.groups, "
             "kvserve.kv.manager; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"

"""Prompt-cache files as an attacker would write them: a file that labels one prompt's K/V with another
prompt's tokens (forged without the user's secret) is refused and poisons nothing; files with crafted
fields, even correctly keyed, are refused with one line and never a traceback, from the library, from
``kvserve cache info`` and from the chat's ``/load``."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.kv import prompt_cache
from kvserve.kv.file_framing import pack, unpack, write_atomically
from kvserve.kv.prompt_cache import (
    MAGIC,
    PromptCacheError,
    load_prompt_cache,
    read_prompt_cache,
    save_prompt_cache,
)
from tests.support import make_engine


def _run(engine, prompt, n=8):
    from kvserve.engine.sampling_params import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).request_id
    return engine.run_to_completion()[rid]


@pytest.fixture(scope="module")
def saved(tiny_llama_hd64, tmp_path_factory):
    """A genuine file of a 64-token prompt, its header and payload."""
    engine = make_engine(tiny_llama_hd64)
    prompt = [(7 * i + 3) % 80 + 10 for i in range(64)]
    _run(engine, prompt)
    path = tmp_path_factory.mktemp("kvc") / "genuine.kvc"
    save_prompt_cache(engine.cache, prompt, path)
    header, payload = read_prompt_cache(path)
    return path, header, bytes(payload), prompt


def test_a_forged_file_is_refused_and_poisons_nothing(tiny_llama_hd64, saved, tmp_path):
    _, header, payload, _ = saved
    victim = [(11 * i + 5) % 80 + 10 for i in range(64)]
    forged = tmp_path / "forged.kvc"
    # the genuine K/V relabelled with the victim's tokens, under a key that is not the user's secret
    write_atomically(forged, pack(MAGIC, {**header, "tokens": victim}, payload, b"x" * 32))
    engine = make_engine(tiny_llama_hd64)
    with pytest.raises(PromptCacheError, match="secret"):
        load_prompt_cache(engine.cache, forged)
    assert _run(engine, victim).metrics.num_cached_tokens == 0  # nothing of the victim's prompt was cached
    unkeyed = tmp_path / "old.kvc"
    write_atomically(unkeyed, pack(b"KVSPC01\n", {**header, "tokens": victim}, payload))
    with pytest.raises(PromptCacheError, match="older kvserve"):
        load_prompt_cache(engine.cache, unkeyed)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["tokens", "blocks", "extra", "window_blocks", "identity"]), value=JSON)
@example(field="identity", value={"\n": False})  # a key of the file's own once reached the message
@example(field="identity", value={1: "x", "a": 2})  # keys that do not sort together
def test_crafted_fields_are_one_line_refusals(tiny_llama_hd64, saved, tmp_path_factory, field, value):
    _, header, payload, _ = saved
    path = tmp_path_factory.mktemp("crafted") / "c.kvc"
    # keyed correctly: what someone holding the secret could write; still never a traceback
    write_atomically(path, pack(MAGIC, {**header, field: value}, payload, prompt_cache._key()))
    engine = make_engine(tiny_llama_hd64, num_ctx=256)
    try:
        load_prompt_cache(engine.cache, path)
    except PromptCacheError as e:
        assert "\n" not in str(e)


def test_the_cli_and_the_chat_refuse_crafted_files(saved, tmp_path):
    _, header, payload, _ = saved
    crafted = tmp_path / "crafted.kvc"
    write_atomically(crafted,
                     pack(MAGIC, {**header, "extra": [1, 2], "tokens": ["a"]}, payload, prompt_cache._key()))
    r = subprocess.run([sys.executable, "-m", "kvserve", "cache", "info", str(crafted)], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "'tokens'" in r.stderr, r.stderr
    from kvserve.cli.chat import _save_or_load

    class Chat:
        history, tokens, system = [], [], None

    # prints the error; the chat goes on (the file is refused before its cache is touched)
    _save_or_load("/load", crafted, SimpleNamespace(cache=None), Chat())


def test_a_genuine_file_still_loads(tiny_llama_hd64, saved):
    path, header, _, prompt = saved
    engine = make_engine(tiny_llama_hd64)
    tokens, _ = load_prompt_cache(engine.cache, path)
    # the last block is recomputed
    assert tokens == 64 and _run(engine, prompt).metrics.num_cached_tokens == 48
    assert json.loads(json.dumps(unpack(path.read_bytes(), MAGIC, prompt_cache._key())[0])) == header

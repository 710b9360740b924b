"""Both APIs' parameters mapped onto one ``SamplingParams`` (no model, no server)."""

from __future__ import annotations

import pytest

from kvserve.server.api_errors import APIError
from kvserve.server.ollama.api import ollama_params
from kvserve.server.ollama.schemas import Options
from kvserve.server.openai.chat_api import _params
from kvserve.server.openai.chat_schemas import ChatCompletionRequest
from kvserve.server.server_config import ServerConfig

CTX = 512


def test_ollama_defaults_and_context_room():
    p = ollama_params(None, 100, CTX, None)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.8, 40, 0.9, 0.0, 1.0)
    assert p.max_tokens == CTX - 100 and p.seed is None and p.logprobs is None


@pytest.mark.parametrize("num_predict,expected", [(None, 412), (-1, 412), (-2, 412), (7, 7), (1000, 412)])
def test_ollama_num_predict(num_predict, expected):
    assert ollama_params(Options(num_predict=num_predict), 100, CTX, None).max_tokens == expected


def test_ollama_num_ctx_shrinks_but_never_grows_the_context():
    assert ollama_params(Options(num_ctx=128), 100, CTX, None).max_tokens == 28
    with pytest.raises(APIError, match="the prompt is 100 tokens but the context limit is 64"):
        ollama_params(Options(num_ctx=64), 100, CTX, None)
    # a larger one is served at the server's context (Ollama serves what memory allows)
    assert ollama_params(Options(num_ctx=4096), 100, CTX, None).max_tokens == CTX - 100


def test_ollama_options_map_one_to_one():
    o = Options(
        temperature=0,
        top_k=5,
        top_p=0.5,
        min_p=0.1,
        seed=9,
        stop=["x"],
        repeat_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    p = ollama_params(o, 10, CTX, 3)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stop) == (0, 5, 0.5, 0.1, 9, ("x",))
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.logprobs) == (1.3, 0.5, 0.25, 3)
    assert ollama_params(Options(seed=-1), 10, CTX, None).seed is None  # Ollama's "random"
    assert (
        ollama_params(Options(repeat_penalty=1.3, repeat_last_n=0), 10, CTX, None).repetition_penalty == 1.0
    )


def test_openai_mapping_and_seeds_per_choice():
    body = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        seed=2**64 - 1,
        top_k=7,
        min_p=0.2,
        repetition_penalty=1.1,
        stop="END",
        ignore_eos=True,
    )
    config = ServerConfig(model_name="m")
    first, second = _params(body, config, 5, None, 0), _params(body, config, 5, None, 1)
    assert first.seed == 2**64 - 1 and second.seed == 0  # distinct, reproducible, in torch's range
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (1.0, 1.0, 7, 0.2)
    assert (first.repetition_penalty, first.stop, first.ignore_eos, first.max_tokens) == (
        1.1,
        ("END",),
        True,
        5,
    )
    # a server's --temperature is the default of a request that sets none, never more
    greedy = ServerConfig(model_name="m", temperature=0.0)
    assert _params(body, greedy, 5, None, 0).temperature == 0.0
    assert _params(body.model_copy(update={"temperature": 0.7}), greedy, 5, None, 0).temperature == 0.7
    assert ollama_params(None, 10, CTX, None, default_temperature=0.0).temperature == 0.0
    assert ollama_params(Options(temperature=0.5), 10, CTX, None, default_temperature=0.0).temperature == 0.5

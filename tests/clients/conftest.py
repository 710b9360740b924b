"""The client libraries' tests run against SmolLM2 (the server tests' process) and Gemma 3 270M (a
process of their own): ``live`` is (server, model name)."""

import os

import pytest

from tests.server.conftest import idle, serve, server  # noqa: F401 (fixtures)

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches prices from the web otherwise


@pytest.fixture(scope="session")
def gemma(tmp_path_factory):
    # exact weights, as the SmolLM2 server's: greedy answers must not depend on the CPU's kernels
    yield from serve(tmp_path_factory, "gemma3-270m", "-c", "1024", "--weights", "q4", "--cache-type", "f32")


@pytest.fixture(params=["smollm2", "gemma3-270m"])
def live(request):
    if request.param == "smollm2":
        return request.getfixturevalue("idle"), "smollm2"
    return request.getfixturevalue("gemma"), "gemma3-270m"

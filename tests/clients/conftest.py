"""The client libraries' tests share the server tests' ``kvserve serve smollm2`` process."""

import os

from tests.server.conftest import idle, server  # noqa: F401 (fixtures)

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches prices from the web otherwise

"""The security tests attack the server tests' ``kvserve serve smollm2`` process."""

from tests.server.conftest import idle, server  # noqa: F401 (fixtures)

"""Behind --replicas the ingress refuses what every replica would (an empty prompt, one too long for a
context that does not shift) before anything reaches a replica: the error comes with the first step of
``RemoteEngine.generate``, where ``Serving.start`` turns it into a 400 before a stream starts."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'kvserve[ray]'")

from kvserve.errors import PromptTooLongError
from kvserve.server.replicas.ray_ingress import RemoteEngine, ReplicaFacts


class Sent(Exception):
    """What the stand-in handle raises: the request went on to a replica."""


class StubHandle:
    def options(self, **kwargs):
        raise Sent


def first_step(engine: RemoteEngine, prompt: list[int]):
    return asyncio.run(engine.generate(prompt).__anext__())


def test_what_no_replica_would_admit_is_refused_at_the_ingress():
    engine = RemoteEngine(StubHandle(), ReplicaFacts(None, 16, None))
    with pytest.raises(PromptTooLongError, match="16 tokens but the context limit is 16"):
        first_step(engine, list(range(1, 17)))
    with pytest.raises(ValueError, match="empty"):
        first_step(engine, [])
    with pytest.raises(Sent):
        first_step(engine, list(range(1, 16)))  # fits: on to a replica


def test_a_long_prompt_goes_on_where_the_replicas_shift_the_context():
    engine = RemoteEngine(StubHandle(), ReplicaFacts(None, 16, None, shifts_context=True))
    with pytest.raises(Sent):
        first_step(engine, list(range(1, 40)))

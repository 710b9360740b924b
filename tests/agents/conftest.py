"""Coding agents from the npm registry against ``kvserve serve qwen2.5-coder-0.5b``, through a recording proxy
that keeps every request the agent sent and every answer it got.

The agents are installed by ``make agents`` (part of ``make test`` where npm is present) into
``build/agents`` at the versions ``tests/agents/package.json`` pins; without them these tests report
themselves skipped. The server answers greedily (``--temperature 0``: the agents send no temperature), so a
run is the same run each time for the same prompt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvserve.benchmark.agent_task import scratch_project
from kvserve.benchmark.recording_proxy import Recorder, RecordingProxy
from tests.server.conftest import API_KEY, Server, serve

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "build" / "agents" / "node_modules" / ".bin"
MODEL = "qwen2.5-coder-0.5b"
CONTEXT = 32768
AGENT_TIMEOUT = 720  # seconds a session may take: its first prompt is read cold (15-20K tokens)


def agent_binary(name: str) -> Path:
    path = AGENTS / name
    if shutil.which("node") is None or not path.exists():
        pytest.skip(f"{name} is not installed (make agents: needs node and npm)")
    return path


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory) -> Server:
    """One Qwen2.5-Coder server for every agent: two threads (the prompts are long), its context the
    agents'."""
    yield from serve(tmp_path_factory, MODEL, "-c", str(CONTEXT), "-t", "2", "--max-num-seqs", "4",
                     "--temperature", "0")


@dataclass
class Session:
    """One agent run: its output and the exchanges the proxy recorded."""

    returncode: int
    output: str
    records: list[dict]

    def failures(self) -> list[str]:
        return [f"{r['method']} {r['path']} -> {r['status']}: {r.get('response', '')[:300]}"
                for r in self.records if r["status"] >= 400]


@pytest.fixture
def run_agent(agent_server: Server, tmp_path):
    """``run_agent(argv, env)``: the agent in a scratch git repository (``calc.py`` committed), with a home
    of its own, its requests going through a recording proxy (``{proxy}`` in argv and env values)."""
    repo = scratch_project(tmp_path / "repo")
    home = tmp_path / "home"
    home.mkdir()

    def run(argv: list[str], env: dict[str, str], files: dict[str, str] | None = None) -> Session:
        recorder = Recorder(keep_responses=True)
        with RecordingProxy(agent_server.url, recorder) as proxy:
            values = {"{proxy}": proxy.url, "{key}": API_KEY, "{repo}": str(repo)}

            def fill(text: str) -> str:
                for name, value in values.items():
                    text = text.replace(name, value)
                return text

            for rel, text in (files or {}).items():
                target = home / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(fill(text))
            full_env = {"PATH": os.environ["PATH"], "HOME": str(home), "TERM": "dumb", "NO_COLOR": "1",
                        **{k: fill(v) for k, v in env.items()}}
            agent = subprocess.Popen([fill(a) for a in argv], cwd=repo, env=full_env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
            try:
                output, _ = agent.communicate(timeout=AGENT_TIMEOUT)
            except subprocess.TimeoutExpired:
                agent.kill()
                output = agent.communicate()[0] + f"\n[killed after {AGENT_TIMEOUT} s]"
        return Session(agent.returncode, output, list(recorder.records))

    run.repo = repo
    return run

"""The task a coding agent is given in ``tests/agents`` and ``bench/agent_session.py``: one scratch project
and a first message that names the tool call to make.

A 0.5B model left to itself often answers in prose, or asks for the same call again and again; the message
names the call (as the JSON object Qwen2.5-Coder writes, which the call grammar turns into a call of one of
the agent's real tools) and the project's one file ends the task once it has been read.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

CALC = (
    "def add(a, b):\n    return a - b\n\n"
    "# The file is read. Now stop calling tools and reply with the single word DONE.\n"
)


def scratch_project(repo: Path) -> Path:
    """``repo`` made a git repository holding ``calc.py``, committed (the agents read the git status)."""
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "calc.py").write_text(CALC)
    git = ["git", "-c", "user.email=agent@example.com", "-c", "user.name=agent"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=repo, check=True)
    return repo


def call_prompt(name: str, arguments: dict) -> str:
    return f"Respond with exactly this tool call: {json.dumps({'name': name, 'arguments': arguments})}"

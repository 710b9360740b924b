"""A coding agent's session, recorded once and replayed against kvserve and llama.cpp's own ``llama-server``.

    # record: the agent (from build/agents: make agents) runs a task against kvserve through a recording
    # proxy; --sessions 2 runs it twice in one project on one server, each session with its own first message
    .venv/bin/python bench/agent_session.py record claude --out sessions/claude.jsonl --sessions 2
    # replay: each recorded request, as the agent sent it and in order, against each server started fresh;
    # several files (two sessions of one agent) one after the other on the same server
    .venv/bin/python bench/agent_session.py replay sessions/claude-1.jsonl sessions/claude-2.jsonl \\
        [--peers kvserve,llama.cpp] [--json OUT]

Both servers get the same model file, context (-c, 32768) and 2 threads; llama-server runs one slot with its
prompt cache on (its defaults: cache_prompt, and a RAM cache of earlier prompts where its version has one).
The second file of a replay is a new session of the same agent: what it finds in the cache is what a user's
next session would. Per round trip: prompt tokens, tokens computed and reused, TTFT (to the first event that
carries output: text or a call), the request's time; per session the totals.

The replay decodes greedily and at most --max-tokens (256) per request, on both servers: a session's cost is
its prompts, and two servers sampling at an agent's temperature would otherwise write answers of different
lengths. The prompts, tools and history are sent as recorded.
A benchmark, not a test: the figures are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from local_server import free_port, local_server  # bench/ is the script's folder: on sys.path

from kvserve.benchmark.agent_task import call_prompt, scratch_project
from kvserve.benchmark.recording_proxy import Recorder, RecordingProxy

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "build" / "agents" / "node_modules" / ".bin"
LLAMA_SERVER = ROOT / "build" / "llama.cpp" / "bin" / "llama-server"
MODEL = "qwen2.5-coder-0.5b"
CONTEXT = 32768
# each session's first message names the call to write (kvserve.benchmark.agent_task says why)
CALLS = {
    "claude": (("Read", {"file_path": "{repo}/calc.py"}), ("Bash", {"command": "head -n 20 calc.py"})),
    "codex": (("exec_command", {"cmd": "cat calc.py"}), ("exec_command", {"cmd": "head -n 20 calc.py"})),
    "qwen": (("read_file", {"file_path": "{repo}/calc.py"}),
             ("run_shell_command", {"command": "head -n 20 calc.py"})),
}
# how each agent is started: argv, environment (``{proxy}``, ``{key}`` filled in), files under its HOME
AGENT_RUNS = {
    "claude": ([str(AGENTS / "claude"), "-p", "{prompt}", "--model", MODEL],
               {"ANTHROPIC_BASE_URL": "{proxy}", "ANTHROPIC_API_KEY": "{key}",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, {}),
    "codex": ([str(AGENTS / "codex"), "exec", "--skip-git-repo-check", "{prompt}"],
              {"KVSERVE_API_KEY": "{key}"}, {
                  ".codex/config.toml": f'model = "{MODEL}"\nmodel_provider = '
                                        f'"kvserve"\n\n[model_providers.kvserve]\n'
                                     'name = "kvserve"\nbase_url = "{proxy}/v1"\nwire_api = "responses"\n'
                                     'env_key = "KVSERVE_API_KEY"\n'}),
    "qwen": ([str(AGENTS / "qwen"), "--auth-type", "openai", "{prompt}"],
             {"OPENAI_BASE_URL": "{proxy}/v1", "OPENAI_API_KEY": "{key}", "OPENAI_MODEL": MODEL}, {}),
}


def record(agent: str, out: Path, prompts: list[str], timeout: float) -> None:
    """Each prompt is one session, all in one repository and HOME against one server, as a user's next session
    in the same project would be (the agents write the working directory and the git status into their system
    text: a new directory would be a new prefix); ``out``-1.jsonl, -2.jsonl, ..."""
    with tempfile.TemporaryDirectory() as tmp, local_server(MODEL, "-c", str(CONTEXT), "-t", "2") as (url, _):
        repo, home = scratch_project(Path(tmp) / "repo"), Path(tmp) / "home"
        home.mkdir()
        for i, prompt in enumerate(prompts, 1):
            path = out if len(prompts) == 1 else out.with_name(f"{out.stem}-{i}{out.suffix}")
            _record_session(agent, url, repo, home, path, prompt, timeout)


def _record_session(agent: str, url: str, repo: Path, home: Path, out: Path, prompt: str,
                    timeout: float) -> None:
    argv, env, files = AGENT_RUNS[agent]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with RecordingProxy(url, Recorder(out)) as proxy:
        fill = {"proxy": proxy.url, "key": "unused", "prompt": prompt.replace("{repo}", str(repo))}
        for rel, text in files.items():
            (home / rel).parent.mkdir(parents=True, exist_ok=True)
            (home / rel).write_text(text.replace("{proxy}", proxy.url))
        started = time.monotonic()
        agent_proc = subprocess.Popen([a.format(**fill) for a in argv], cwd=repo, stdin=subprocess.DEVNULL,
                                      env={"PATH": os.environ["PATH"], "HOME": str(home),
                                           **{k: v.format(**fill) for k, v in env.items()}},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
        try:
            said, _ = agent_proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a small model's session may never end: what it sent is kept
            os.killpg(agent_proc.pid, signal.SIGKILL)  # the agent's children too: they hold the pipe
            said, _ = agent_proc.communicate()
            said += f"\n[stopped after {timeout:.0f} s]"
    print(said[-2000:])
    print(f"{agent}: {sum(1 for _ in out.open())} requests in {time.monotonic() - started:.0f} s -> {out}")


# --- replay ------------------------------------------------------------------------------------------------
def replay_one(client: httpx.Client, record: dict, max_tokens: int) -> dict:
    """One recorded request sent again (greedy, at most ``max_tokens``); its timings and token counts as the
    server reports them."""
    body = _capped(record["path"], record["body"], max_tokens)
    began = time.perf_counter()
    first = None
    events: list[dict] = []
    last, silence = began, 0.0  # the longest wait for a byte before the first output
    with client.stream(record["method"], record["path"], json=body, headers=record.get("headers", {})) as r:
        raw = b""
        for chunk in r.iter_bytes():
            now = time.perf_counter()
            if first is None:
                silence, last = max(silence, now - last), now
            raw += chunk
            if first is None and _carries_output(chunk):
                first = now
        status = r.status_code
    done = time.perf_counter()
    text = raw.decode(errors="replace")
    if body and body.get("stream"):
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]")]
    elif text.strip().startswith("{"):
        events = [json.loads(text)]
    prompt, computed = _tokens(events)
    return {"path": record["path"], "status": status, "seconds": done - began,
            "ttft": (first or done) - began, "max_silence": silence, "prompt": prompt, "computed": computed}


def _capped(path: str, body: dict, max_tokens: int) -> dict:
    """The body with temperature 0 and its output limit at most ``max_tokens``, in the field its API uses."""
    body = dict(body)
    if path.startswith("/api/"):  # Ollama
        body["options"] = {**(body.get("options") or {}), "temperature": 0, "num_predict": max_tokens}
        return body
    body["temperature"] = 0
    body.pop("top_p", None)
    body.pop("top_k", None)
    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        if key in body:
            body[key] = min(body[key] or max_tokens, max_tokens)
            break
    else:
        body["max_output_tokens" if "input" in body else "max_tokens"] = max_tokens
    return body


OUTPUT_MARKS = (b'"text_delta"', b'"input_json_delta"', b'"tool_use"', b"output_text.delta",
                b'"function_call"', b'"content":"', b'"tool_calls"', b'"arguments"')


def _carries_output(chunk: bytes) -> bool:
    """An event with generated text or a call in it (a stream's opening and its pings carry none)."""
    return any(mark in chunk for mark in OUTPUT_MARKS) and b'"content":""' not in chunk


def _tokens(events: list[dict]) -> tuple[int | None, int | None]:
    """(prompt tokens, of which computed) from the last event that says: llama.cpp's ``timings`` (prompt_n
    computed, cache_n reused), else the API's usage (cached tokens reported apart)."""
    prompt = computed = None
    for e in events:
        timings = e.get("timings")
        if isinstance(timings, dict) and "prompt_n" in timings:
            computed = timings["prompt_n"]
            prompt = computed + timings.get("cache_n", 0)
            continue
        usage = e.get("usage") or (e.get("response") or {}).get("usage") or (e.get("message") or {}).get(
            "usage")
        if not isinstance(usage, dict):
            continue
        if "cache_read_input_tokens" in usage:  # Anthropic: input_tokens are the computed ones
            cached = usage.get("cache_read_input_tokens") or 0
            prompt, computed = usage.get("input_tokens", 0) + cached, usage.get("input_tokens", 0)
        elif "input_tokens" in usage:  # Responses
            cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
            prompt, computed = usage["input_tokens"], usage["input_tokens"] - cached
        elif "prompt_tokens" in usage:  # chat completions
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            prompt, computed = usage["prompt_tokens"], usage["prompt_tokens"] - cached
    return prompt, computed


def llama_server(model_path: str):
    """``llama-server`` on a free port: one slot of the whole context, 2 threads, its prompt cache on."""
    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", model_path, "-c", str(CONTEXT), "-t", "2", "-np", "1", "--port",
           str(port), "--jinja", "--no-webui"]
    log = Path(tempfile.gettempdir()) / f"agent_session-llama-server-{port}.log"
    print(f"llama-server log: {log}", file=sys.stderr)
    return port, subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def replay(paths: list[Path], peers: list[str], max_tokens: int,
           max_requests: int | None = None) -> list[dict]:
    from kvserve.models.registry import resolve

    model_path = str(resolve(MODEL))
    sessions = [(path.stem, [r for r in map(json.loads, path.open()) if r["method"] == "POST" and r["body"]]
                 [:max_requests]) for path in paths]
    rows = []
    for peer in peers:
        if peer == "kvserve":
            with local_server(MODEL, "-c", str(CONTEXT), "-t", "2") as (url, _):
                rows += _replay_on(url, sessions, peer, max_tokens)
        else:
            port, proc = llama_server(model_path)
            try:
                url = f"http://127.0.0.1:{port}"
                _wait(url, proc)
                rows += _replay_on(url, sessions, peer, max_tokens)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    return rows


def _wait(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not start")


def _replay_on(url: str, sessions: list[tuple[str, list[dict]]], peer: str, max_tokens: int) -> list[dict]:
    rows = []
    headers = {"x-api-key": "unused", "authorization": "Bearer unused"}
    with httpx.Client(base_url=url, timeout=httpx.Timeout(None), headers=headers) as client:
        for name, records in sessions:
            for i, record in enumerate(records):
                row = {"session": name, "engine": peer, "round_trip": i + 1}
                try:
                    row |= replay_one(client, record, max_tokens)
                except httpx.TransportError as e:  # the server went away: the rest of this peer's run is lost
                    print(json.dumps({**row, "error": repr(e)}), flush=True)
                    return rows
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def summary(rows: list[dict]) -> None:
    print(f"\n{'session':16} {'engine':10} {'requests':>8} {'total s':>8} {'prompt tok':>10} {'computed':>9} "
          f"{'reused %':>8} {'first TTFT s':>12} {'max silence s':>13}")
    for name, engine in dict.fromkeys((r["session"], r["engine"]) for r in rows):
        rs = [r for r in rows if (r["session"], r["engine"]) == (name, engine)]
        prompt = sum(r["prompt"] or 0 for r in rs)
        computed = sum(r["computed"] or 0 for r in rs)
        reused = 100 * (prompt - computed) / prompt if prompt else 0
        print(f"{name:16} {engine:10} {len(rs):>8} {sum(r['seconds'] for r in rs):>8.1f} {prompt:>10} "
              f"{computed:>9} {reused:>8.1f} {rs[0]['ttft']:>12.2f} "
              f"{max(r['max_silence'] for r in rs):>13.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("agent", choices=sorted(AGENT_RUNS))
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--prompt", action="append", help="a session's first message (once per session)")
    rec.add_argument("--sessions", type=int, default=1, help="sessions on one server, each with its own "
                     "first message")
    rec.add_argument("--timeout", type=float, default=900,
                     help="seconds a session may take (its requests so far "
                     "are kept)")
    rep = sub.add_parser("replay")
    rep.add_argument("sessions_files", nargs="+", type=Path)
    rep.add_argument("--peers", default="kvserve,llama.cpp")
    rep.add_argument("--json", type=Path, default=None)
    rep.add_argument("--max-tokens", type=int, default=256, help="output limit per replayed request")
    rep.add_argument("--max-requests", type=int, default=None,
                     help="replay each session's first N requests only "
                     "(a small model's session that loops on a declined call)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if args.command == "record":
        calls = CALLS[args.agent]
        prompts = args.prompt or [call_prompt(*calls[i % len(calls)]) for i in range(args.sessions)]
        record(args.agent, args.out, prompts, args.timeout)
        return
    peers = args.peers.split(",")
    if "llama.cpp" in peers and not LLAMA_SERVER.exists():
        sys.exit(f"{LLAMA_SERVER} is missing: make llama-cpp")
    rows = replay(args.sessions_files, peers, args.max_tokens, args.max_requests)
    summary(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

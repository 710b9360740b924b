"""A ``kvserve serve`` process on a free loopback port for the benchmark scripts, stopped on exit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(model: str | list[str], *flags: str, timeout: float = 300) -> Iterator[tuple[str, int]]:
    """Yields (the server's URL, its process id) once /health answers; its log is printed if it fails to
    start. ``model``: one, or several (``kvserve serve A B ...``)."""
    port = free_port()
    models = [model] if isinstance(model, str) else model
    cmd = [sys.executable, "-m", "kvserve", "serve", *models, "--port", str(port), "--no-access-log", *flags]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the server did not start:\n{log.read().decode()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

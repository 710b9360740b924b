"""``kvserve serve --replicas``: the error lines it gives before any Ray instance or model starts."""

from __future__ import annotations

import socket
import sys

import pytest

from kvserve.cli.main import main


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_without_ray_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code, err = run(["serve", "smollm2", "--replicas", "2"], capsys)
    assert code == 1
    assert err.strip() == "error: --replicas needs Ray Serve: pip install 'kvserve[ray]'"


def test_an_unreachable_cluster_is_one_line(capsys):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvserve[ray]'")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = run(["serve", "smollm2", "--replicas", "2", "--ray-address", f"127.0.0.1:{port}"], capsys)
    assert code == 1
    assert err.startswith(f"error: no Ray cluster at 127.0.0.1:{port}: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ray-address", "127.0.0.1:6379"], "error: --ray-address needs --replicas N"),
        (["--replicas", "0"], "error: --replicas must be >= 1, got 0"),
        (["--replicas", "2", "--ray-address", "nohost"], "error: --ray-address must be HOST:PORT"),
        (["--replicas", "2", "--kv-events", "tcp://*:5557"], "error: --kv-events is per engine"),
    ],
)
def test_bad_flags(argv, message, capsys):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvserve[ray]'")
    code, err = run(["serve", "smollm2", *argv], capsys)
    assert code == 1
    assert err.startswith(message)


def test_more_replicas_than_cores_on_this_machine(capsys):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvserve[ray]'")
    code, err = run(["serve", "smollm2", "--replicas", "1", "-t", "100000"], capsys)
    assert code == 1
    assert err.startswith("error: 1 replica of 100000 threads need 100000 cores; this machine has ")

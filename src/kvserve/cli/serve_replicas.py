"""``kvserve serve --replicas N [--ray-address ADDR]``: the server as Ray Serve deployments
(``server.ray_serve``), on a Ray instance started here or on an existing cluster."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import threading

from kvserve.cli.options import engine_config
from kvserve.server.server_config import ServerConfig

APP_NAME = "kvserve"


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds with a clear line, not after Ray's own minute of retries, when nothing listens at
    ADDR. 'auto' (the cluster this machine joined) is left to Ray."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--ray-address must be HOST:PORT, ray://HOST:PORT or 'auto', got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise ValueError(
            f"no Ray cluster at {address}: {reason}; start one with 'ray start --head' "
            f"or leave out --ray-address to run Ray on this machine"
        ) from None


def check_cores(num_replicas: int, num_threads: int) -> None:
    """Ray starts no replica it has no CPUs for: without this, the command would wait forever."""
    cores = os.cpu_count() or 1
    if num_replicas * num_threads > cores:
        raise ValueError(
            f"{num_replicas} replica{'s' if num_replicas > 1 else ''} of {num_threads} threads need "
            f"{num_replicas * num_threads} cores; this "
            f"machine has {cores}: lower --replicas or -t, or join a cluster with --ray-address"
        )


def connect(address: str | None) -> None:
    import ray

    if address is not None:
        check_reachable(address)
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)


def run_replicas(args: argparse.Namespace, config: ServerConfig) -> int:
    try:
        from ray import serve
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'kvserve[ray]'") from None
    from kvserve.server.app import build_app
    from kvserve.server.replicas.ray_serve import build_application

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if config.kv_events:
        raise ValueError("--kv-events is per engine; it does not combine with --replicas")
    engine = engine_config(args)
    if engine.num_threads is None:  # one core each unless told: Ray reserves what a replica uses
        engine = dataclasses.replace(engine, num_threads=1)
    if args.ray_address is None:
        check_cores(args.replicas, engine.num_threads)
    connect(args.ray_address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(
                build_application(engine, config, args.replicas, build_app, args.prompt_cache),
                name=APP_NAME,
                route_prefix="/",
                blocking=False,
            )
        except RuntimeError as e:  # a replica failed to start: Ray's message names it, its log says why
            raise ValueError(f"the replicas did not start: {e}") from None
        url = f"http://{args.host}:{args.port}"
        print(
            f"serving {config.model_name} on {url} with {args.replicas} replicas (OpenAI: {url}/v1, "
            f"Ollama: {url}/api); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        wait_for_signal()
    finally:
        shut_down(args.ray_address is None)
    return 0


def wait_for_signal() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass


def shut_down(local: bool) -> None:
    """A Ray instance started here goes with its replicas; on a cluster only our app is removed."""
    import ray
    from ray import serve

    if local:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP_NAME)

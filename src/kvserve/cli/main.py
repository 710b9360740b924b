"""``kvserve`` command line: one module per subcommand, each with ``add_parser`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvserve import __version__

SUBCOMMANDS = {
    "run": "kvserve.cli.run",
    "pull": "kvserve.cli.models",
    "list": "kvserve.cli.models",
    "plan": "kvserve.cli.plan",
    "serve": "kvserve.cli.serve",
    "eval": "kvserve.cli.eval",
    "bench": "kvserve.cli.bench",
    "cache": "kvserve.cli.cache",
    "top": "kvserve.cli.top",
    "doctor": "kvserve.cli.doctor",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve",
                                     description="Run and measure LLMs around their KV cache.")
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from kvserve.errors import KVServeError

    try:
        return int(args.handler(args) or 0)
    except (KVServeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0

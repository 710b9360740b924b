"""Natural text every Python install has: the pydoc topic help (``pydoc_data.topics``)."""

from __future__ import annotations

from pathlib import Path


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def load_text(path: str | None) -> str:
    if path is None:
        return default_text()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such text file")
    return p.read_text(encoding="utf-8", errors="replace")

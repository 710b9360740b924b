"""The docs keep up with the code: every module under src/kvserve is in docs/architecture.md's file map,
under its package, and every relative link in the README and docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "kvserve"


def _modules() -> set[tuple[str, str]]:
    found = set()
    for path in SOURCE.rglob("*"):
        if path.suffix in (".py", ".c", ".h") and path.name not in ("__init__.py", "__main__.py") \
                and "__pycache__" not in path.parts:
            package = path.parent.relative_to(SOURCE).as_posix()
            found.add(("" if package == "." else package, path.name))
    return found


def _mapped() -> set[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("```\nsrc/kvserve/") :].split("```")[1]
    mapped, package = set(), ""
    for line in block.splitlines()[2:]:
        if re.fullmatch(r"  [\w/]+/", line):
            package = line.strip().rstrip("/")
        elif m := re.match(r"    (\S+\.(?:py|c|h))\s", line + " "):
            mapped.add((package, m.group(1)))
    return mapped


def test_every_module_is_in_the_file_map():
    missing = sorted(f"{p}/{n}".lstrip("/") for p, n in _modules() - _mapped())
    gone = sorted(f"{p}/{n}".lstrip("/") for p, n in _mapped() - _modules())
    assert not missing, f"add to docs/architecture.md's file map: {missing}"
    assert not gone, f"docs/architecture.md maps files that are gone: {gone}"


def test_relative_links_point_at_files():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken

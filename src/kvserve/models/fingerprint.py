"""A model's fingerprint: which file (or folder) the weights came from, in a few milliseconds.

Hashing every byte of a multi-GB file at each start would cost seconds, so the fingerprint reads
what tells files apart without doing that: each file's name and size, its first MiB (a GGUF's
metadata and tensor table, a safetensors header, a config) and 64 slices of 4 KiB spread over the
rest. Two files that differ only in bytes none of these cover would share it; no real fine-tune or
requantization does that, but a tool that edits a few weights in place could.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HEAD_BYTES = 1 << 20
NUM_SAMPLES = 64
SAMPLE_BYTES = 4096
FOLDER_SUFFIXES = {".safetensors", ".json", ".model", ".txt", ".bin"}  # what a HF folder's model is made of


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES:
            step = (size - HEAD_BYTES) // NUM_SAMPLES
            for i in range(NUM_SAMPLES):
                f.seek(HEAD_BYTES + i * step)
                h.update(f.read(SAMPLE_BYTES))


def model_fingerprint(path: str | os.PathLike) -> str:
    path = Path(path)
    h = hashlib.blake2b(digest_size=16, person=b"kvserve-model")
    files = (
        sorted(p for p in path.iterdir() if p.is_file() and p.suffix in FOLDER_SUFFIXES)
        if path.is_dir()
        else [path]
    )
    for f in files:
        _file_digest(f, h)
    return h.hexdigest()

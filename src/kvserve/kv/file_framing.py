"""The framing shared by KV files (disk-tier blocks, prompt-cache files): nothing is trusted until
the whole file checks out.

    offset      size  field
    0           8     magic (which kind of file, and its format version)
    8           4     header length H, little-endian
    12          H     header: UTF-8 JSON (what the payload holds, for which engine setup, and the
                      payload's length and CRC-32)
    12 + H      P     payload: K/V bytes exactly as the pool stores them
    12 + H + P  32    BLAKE2b-256 of bytes 0 .. 12 + H, keyed where the file is private

The payload is covered by its CRC-32 in the header (3.7 GB/s here, against BLAKE2b's 0.8: restoring
a 4K-token prompt reads ~100 MB), and the header, CRC included, by the BLAKE2b digest. That catches
damage (a flipped bit, a truncation, another file's bytes) and files written under another key; it
is not meant to stop someone who can write the directory, who could also read its secret.

A file that is too short, too long, has another magic, a header that is not JSON, a payload of
another length or CRC, or a digest that does not match raises ``KVFileError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from pathlib import Path

CHECKSUM_BYTES = 32
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 16 << 20


class KVFileError(ValueError):
    """A KV file that is corrupt, truncated, foreign or of another format."""


def _checksum(head: bytes | memoryview, key: bytes | None) -> bytes:
    return hashlib.blake2b(head, key=key or b"", digest_size=CHECKSUM_BYTES,
                           person=b"kvserve-kvfile").digest()


def pack(magic: bytes, header: dict, payload: bytes | memoryview,
         key: bytes | None = None) -> list[bytes | memoryview]:
    """The file's bytes, as pieces to write one after the other (the payload is not copied)."""
    assert len(magic) == 8
    body = json.dumps({**header, "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload)},
                      separators=(",", ":")).encode()
    head = magic + _HEADER_LEN.pack(len(body)) + body
    return [head, payload, _checksum(head, key)]


def unpack(data: bytes | memoryview, magic: bytes, key: bytes | None = None) -> tuple[dict, memoryview]:
    """(header, payload) of a whole file's bytes."""
    view = memoryview(data)
    if len(view) < 12 + CHECKSUM_BYTES:
        raise KVFileError(f"truncated: {len(view)} bytes")
    if bytes(view[:8]) != magic:
        raise KVFileError(f"not a {magic[:-1].decode(errors='replace')} file (magic {bytes(view[:8])!r})")
    (header_len,) = _HEADER_LEN.unpack(view[8:12])
    if header_len > min(_MAX_HEADER, len(view) - 12 - CHECKSUM_BYTES):
        raise KVFileError(f"truncated or corrupt: header of {header_len} bytes in a file of {len(view)}")
    head_end = 12 + header_len
    if _checksum(view[:head_end], key) != bytes(view[-CHECKSUM_BYTES:]):
        raise KVFileError(
            "checksum mismatch: the file was changed, damaged, truncated or written under another key")
    try:
        header = json.loads(bytes(view[12:head_end]))
        payload_bytes, crc = int(header["payload_bytes"]), int(header["payload_crc32"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVFileError(f"corrupt header: {e}") from None
    if len(view) != head_end + payload_bytes + CHECKSUM_BYTES:
        raise KVFileError(
            f"truncated or corrupt: {len(view)} bytes, the header says "
            f"{head_end + payload_bytes + CHECKSUM_BYTES}")
    payload = view[head_end : head_end + payload_bytes]
    if zlib.crc32(payload) != crc:
        raise KVFileError("payload CRC mismatch: the K/V bytes were changed or damaged")
    return header, payload


def write_atomically(path: Path, pieces: list[bytes | memoryview]) -> int:
    """Write ``pieces`` to ``path`` through a temporary name and a rename: a reader sees the whole file
    or none. Returns the bytes written; raises OSError (the temporary file removed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.writelines(pieces)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return sum(len(p) for p in pieces)

"""The framing shared by KV files (disk-tier blocks, prompt-cache files): nothing is trusted until
the whole file checks out.

    offset      size  field
    0           8     magic (which kind of file, and its format version)
    8           4     header length H, little-endian
    12          H     header: UTF-8 JSON (what the payload holds and for which engine setup)
    12 + H      P     payload: K/V bytes exactly as the pool stores them (header["payload_bytes"])
    12 + H + P  32    BLAKE2b-256 of everything before, keyed where the file is private

A file that is too short, too long, has another magic, a header that is not JSON, a payload of
another length or a checksum that does not match raises ``KVFileError``.
"""

from __future__ import annotations

import hashlib
import json
import struct

CHECKSUM_BYTES = 32
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 16 << 20


class KVFileError(ValueError):
    """A KV file that is corrupt, truncated, foreign or of another format."""


def _checksum(parts: list[bytes | memoryview], key: bytes | None) -> bytes:
    h = hashlib.blake2b(key=key or b"", digest_size=CHECKSUM_BYTES, person=b"kvserve-kvfile")
    for part in parts:
        h.update(part)
    return h.digest()


def pack(magic: bytes, header: dict, payload: bytes | memoryview, key: bytes | None = None) -> list[bytes | memoryview]:
    """The file's bytes, as pieces to write one after the other (the payload is not copied)."""
    assert len(magic) == 8
    body = json.dumps({**header, "payload_bytes": len(payload)}, separators=(",", ":")).encode()
    head = magic + _HEADER_LEN.pack(len(body)) + body
    return [head, payload, _checksum([head, payload], key)]


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
    try:
        header = json.loads(bytes(view[12 : 12 + header_len]))
        payload_bytes = int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise KVFileError(f"corrupt header: {e}") from None
    end = 12 + header_len + payload_bytes
    if len(view) != end + CHECKSUM_BYTES:
        raise KVFileError(f"truncated or corrupt: {len(view)} bytes, the header says {end + CHECKSUM_BYTES}")
    if _checksum([view[:end]], key) != bytes(view[end:]):
        raise KVFileError("checksum mismatch: the file was changed, damaged, or written under another key")
    return header, view[12 + header_len : end]

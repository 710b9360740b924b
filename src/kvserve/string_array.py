"""Many strings kept as their bytes (a GGUF vocabulary or merges list), read like a list of str.

Here, below the model readers and the tokenizers, so that both take the same object: the GGUF header
reader makes it, the SentencePiece tokenizer hands its bytes to the kernel as they are.
"""

from __future__ import annotations

from collections.abc import Sequence


class StringArray(Sequence):
    """A long GGUF string array (a vocabulary, merges) kept as the file's bytes: string i is
    ``data[starts[i] : starts[i] + lengths[i]]``, each behind its 8-byte length. Reads like a list of str,
    decoded as the GGUF header reader decodes (invalid UTF-8 replaced), one string per index or all at once
    when iterated; equal to a list of the same strings. Gemma 3's 262k pieces: ~9 MiB here, 43 MiB as
    Python strings (its SentencePiece tokenizer reads the bytes and never needs them all as str)."""

    def __init__(self, data: bytes, starts, lengths) -> None:
        self.data, self.starts, self.lengths = data, starts, lengths

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        start = int(self.starts[index])
        return self.data[start : start + int(self.lengths[index])].decode("utf-8", errors="replace")

    def tolist(self) -> list[str]:
        import numpy as np

        return decoded(np.frombuffer(self.data, dtype=np.uint8), 0, self.starts, self.lengths)

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, StringArray | list | tuple):
            return len(self) == len(other) and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


def decoded(view, base: int, starts, lengths) -> list[str]:
    """The strings at ``view[base + start : base + start + length]``, decoded as the header reader decodes
    one: the run of them copied once with each 8-byte length prefix zeroed, decoded at once and split at
    those eight NULs (a decode per string is most of the time for a 300k vocabulary; an index per byte cost
    Gemma 3's load 34 MiB of peak); one at a time where a string holds a NUL itself."""
    import numpy as np

    if len(starts) == 0:
        return []
    first = base + int(starts[0]) - 8
    region = view[first : base + int(starts[-1] + lengths[-1])].copy()
    at = starts - (int(starts[0]) - 8)
    for k in range(1, 9):
        region[at - k] = 0
    if int(np.count_nonzero(region == 0)) == 8 * len(starts):
        parts = region.tobytes().decode("utf-8", errors="replace").split("\0" * 8)
        if len(parts) == len(starts) + 1:
            return parts[1:]
    raw = bytes(view[base:])
    return [raw[a : a + n].decode("utf-8", errors="replace")
            for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


def spans(strings: Sequence[str]) -> tuple[bytes, object, object]:
    """(bytes, starts, lengths) of ``strings`` as the tokenizer kernels take them (i64 arrays): a
    ``StringArray``'s own, or a list's encoded back to back."""
    import numpy as np

    if isinstance(strings, StringArray):
        return strings.data, strings.starts, strings.lengths
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    starts = np.zeros(len(encoded), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return b"".join(encoded), starts, lengths

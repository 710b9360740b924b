"""The prefix cache's disk tier: full KV blocks as files, found again by block hash after eviction
from RAM and across restarts, bounded in size (least recently used go first), shared safely by
several processes.

    DIR/secret                         32 random bytes (mode 0600): the hashing and checksum key
    DIR/<setup>/<h[:2]>/<h>.kvb        one block; <setup> is a digest of the engine's identity (model
                                       file, weight format, KV types, block size, kernels), <h> its hash
    DIR/<setup>/<w[:2]>/<w>.kvb        with a window group (``kv.groups``): the sliding layers'
                                       part of block <h>, <w> = ``window_part_hash(h)``, parent <h>

A block file is ``file_framing`` (magic KVSBLK01) around the block's bytes as the pool stores
them (a q8_0 block stays q8_0). Its header names the identity, the hash, the parent hash, the
tokens and a digest of the salt; the checksum is keyed with the secret, so a file written by anyone
without it is rejected. A file read back must match all of that; anything else (corrupt, truncated,
foreign) is removed and counted, never used.

Writes happen on a background thread: the engine step only copies the blocks' bytes out of the
pool. Each file is written under a temporary name and renamed, so a reader sees a whole file or
none, and two processes writing the same block both write the same bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import queue
import secrets
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.kv.file_framing import KVFileError, pack, unpack, write_atomically
from kvserve.kv.hashing import window_part_hash

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): evictions of processes sharing a directory may race
    fcntl = None

log = logging.getLogger(__name__)

MAGIC = b"KVSBLK1\n"
SECRET_BYTES = 32
LOW_WATER = 0.9  # an eviction pass frees down to this fraction of the bound, so passes are rare
WRITER_NICE = 10  # the writer yields the cores to the forward (CFS weight 110 vs 1024), yet keeps up
MAX_PENDING_BYTES = 256 << 20  # blocks waiting for the writer; more are dropped, not waited for
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old belongs to a writer that died
# Eviction goes by file time, oldest first. A file's time is when a request last used its block (the
# request's arrival for blocks it wrote, its admission for blocks it found), set back by the block's
# position in the chain: a chain is useless past its first missing block, so of the blocks one request
# used the tail goes first and the head last (as the pool evicts in RAM), even when a long prompt's
# chunks were written seconds apart.
SECONDS_PER_POSITION = 1e-3


# framing, the JSON header (identity, hashes, tokens) and the checksum of one file, at most about
HEADER_ALLOWANCE = 2048


def capacity(max_bytes: int, bytes_per_token: int, block_size: int) -> tuple[int, int]:
    """(bytes of one block file, blocks a directory of ``max_bytes`` holds), for planning."""
    file_bytes = bytes_per_token * block_size + HEADER_ALLOWANCE
    return file_bytes, max_bytes // file_bytes


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve" / "kv-blocks"


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a block file must say about itself to be used for one position of one chain."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    salt_digest: str | None
    index: int = 0  # the block's position in its chain (0: the first block of a prompt)
    used_at: float | None = None  # wall time of the request that wrote it; None: now

    @classmethod
    def in_chain(cls, hashes: list[int], index: int, token_ids: tuple[int, ...], salt_digest: str | None,
                 used_at: float | None = None) -> BlockKey:
        """The key of block ``index`` of a chain whose block hashes are ``hashes``."""
        return cls(hashes[index], hashes[index - 1] if index else None, token_ids, salt_digest, index,
                   used_at)

    def window_part(self) -> BlockKey:
        """The key of this block's window-group part: named by a hash derived from the block's, whose
        parent is the block itself (a file of one cannot pass for the other)."""
        return BlockKey(window_part_hash(self.block_hash), self.block_hash, self.token_ids, self.salt_digest,
                        self.index, self.used_at)

    def header(self) -> dict:
        return {
            "hash": f"{self.block_hash:032x}",
            "parent": None if self.parent_hash is None else f"{self.parent_hash:032x}",
            "tokens": list(self.token_ids),
            "salt": self.salt_digest,
        }


@dataclass(slots=True)
class DiskTierStats:
    """Counts of files: with a window group a block's window part is a file, and a block, of its own."""

    blocks_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    blocks_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    rejected_files: int = 0  # corrupt, truncated or foreign: removed
    dropped_writes: int = 0  # the writer was behind by MAX_PENDING_BYTES, or the disk failed
    evicted_files: int = 0
    blocks_on_disk: int = 0  # the whole directory, every setup, as of the last write or scan
    bytes_on_disk: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class _Pending:
    key: BlockKey
    payload: memoryview
    owner: object = field(default=None)  # keeps the payload's buffer alive


def load_secret(root: Path) -> bytes:
    """The directory's secret, created on first use (atomically: every process gets the same one)."""
    path = root / "secret"
    for _ in range(3):  # read; or create, then read; or remove a damaged one, create, read
        try:
            secret = path.read_bytes()
        except FileNotFoundError:
            tmp = root / f".secret.{os.getpid()}.{threading.get_ident()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(SECRET_BYTES))
            try:
                os.link(tmp, path)  # fails if another process made it first: then theirs is used
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            continue
        if len(secret) == SECRET_BYTES:
            return secret
        log.warning("%s is damaged: a new secret makes every block in the directory unusable", path)
        path.unlink(missing_ok=True)
    raise OSError(f"could not create {path}")


class DiskTier:
    def __init__(self, root: str | os.PathLike, max_bytes: int, identity: dict) -> None:
        if max_bytes < 1:
            raise ValueError(f"the disk cache size must be positive, got {max_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.identity = identity
        self.secret = load_secret(self.root)
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
        self.setup = hashlib.blake2b(canonical, digest_size=12).hexdigest()
        self.dir = self.root / self.setup
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._pending_bytes = 0
        # the writer thread's jobs: ("write", hash) or ("touch", hashes, time); None stops it
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-tier", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    # --- lookups (engine thread) ----------------------------------------------------------------------
    def path(self, block_hash: int) -> Path:
        name = f"{block_hash:032x}"
        return self.dir / name[:2] / f"{name}.kvb"

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            if block_hash in self._pending:
                return True
        return self.path(block_hash).is_file()

    def read(self, key: BlockKey, payload_bytes: int) -> memoryview | None:
        """The block's bytes if a trustworthy file (or a write still queued) holds them, else None."""
        with self._lock:
            pending = self._pending.get(key.block_hash)
        if pending is not None:
            return pending.payload if pending.key.header() == key.header() else None
        start = time.perf_counter()
        path = self.path(key.block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None  # evicted meanwhile, maybe by another process
        try:
            header, payload = unpack(data, MAGIC, self.secret)
            if header.get("identity") != self.identity:
                raise KVFileError("written by another engine setup")
            if {k: header.get(k) for k in ("hash", "parent", "tokens", "salt")} != key.header():
                raise KVFileError("holds another block than its name says")
            if len(payload) != payload_bytes:
                raise KVFileError(f"payload of {len(payload)} bytes, expected {payload_bytes}")
        except KVFileError as e:
            log.warning("disk KV cache: removing %s: %s", path, e)
            path.unlink(missing_ok=True)
            with self._lock:
                self.stats.rejected_files += 1
            return None
        self._touch(path, key)
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += len(data)
            self.stats.read_seconds += time.perf_counter() - start
        return payload

    # --- writes ---------------------------------------------------------------------------------------
    def put(self, key: BlockKey, payload: memoryview, owner: object = None) -> None:
        """Queue one block for writing, unless it is queued already (the writer skips it if it is on
        disk by then). ``owner`` keeps ``payload``'s memory alive until it is written."""
        with self._lock:
            if key.block_hash in self._pending:
                return
            if self._pending_bytes + len(payload) > MAX_PENDING_BYTES:
                self.stats.dropped_writes += 1
                return
            self._pending[key.block_hash] = _Pending(key, payload, owner)
            self._pending_bytes += len(payload)
        self._queue.put(("write", key.block_hash))

    def flush(self) -> None:
        """Wait until every queued block is on disk, then hold the size bound for the whole directory
        (other processes' writes included)."""
        self._queue.join()
        self._scan()

    def close(self) -> None:
        if self._writer.is_alive():
            self.flush()
            self._queue.put(None)
            self._writer.join()
        atexit.unregister(self.close)

    def _write_loop(self) -> None:
        # on Linux a thread has its own nice value: yield the cores to the forward
        if sys.platform == "linux":
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while (job := self._queue.get()) is not None:
            try:
                if job[0] == "write":
                    self._write(job[1])
                else:
                    self._touch_chain(*job[1:])
            except Exception:  # a bug here must not stop the writes after it
                log.exception("disk KV cache: %s failed", job[0])
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, block_hash: int) -> None:
        with self._lock:
            pending = self._pending[block_hash]
        start = time.perf_counter()
        path = self.path(block_hash)
        if path.is_file():  # written meanwhile (another process, or the block was loaded from here)
            self._touch(path, pending.key)
            with self._lock:
                del self._pending[block_hash]
                self._pending_bytes -= len(pending.payload)
            return
        header = {"identity": self.identity, **pending.key.header()}
        size, written = 0, False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            size = write_atomically(path, pack(MAGIC, header, pending.payload, self.secret))
            written = True
            self._touch(path, pending.key)
        except OSError as e:
            log.warning("disk KV cache: cannot write %s: %s", path, e)
        with self._lock:
            del self._pending[block_hash]
            self._pending_bytes -= len(pending.payload)
            if written:
                self.stats.blocks_written += 1
                self.stats.bytes_written += size
                self.stats.write_seconds += time.perf_counter() - start
                self.stats.blocks_on_disk += 1
                self.stats.bytes_on_disk += size
            else:
                self.stats.dropped_writes += 1
            over = self.stats.bytes_on_disk > self.max_bytes
        if over:
            self._scan()

    @staticmethod
    def _touch(path: Path, key: BlockKey) -> None:
        """Mark a block used (see SECONDS_PER_POSITION)."""
        t = (key.used_at or time.time()) - key.index * SECONDS_PER_POSITION
        with contextlib.suppress(OSError):
            os.utime(path, (t, t))

    def touch(self, block_hashes: list[int], first_index: int = 0) -> None:
        """Blocks a request found (in RAM or here), the first of a chain first (at position
        ``first_index``): used now. Done by the writer thread: a long prefix is a system call per
        block, kept off the scheduling step."""
        self._queue.put(("touch", list(block_hashes), time.time(), first_index))

    def _touch_chain(self, block_hashes: list[int], now: float, first_index: int) -> None:
        for i, block_hash in enumerate(block_hashes, first_index):
            self._touch(self.path(block_hash), BlockKey(block_hash, None, (), None, i, now))

    # --- the size bound -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _directory_lock(self):
        if fcntl is None:
            yield
            return
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _scan(self) -> None:
        """Count every block file under the directory and, over the bound, remove the least recently
        used down to LOW_WATER of it. Under the directory's lock: one process evicts at a time."""
        with self._directory_lock():
            files = []
            now = time.time()
            for dirpath, _, names in os.walk(self.root):
                for name in names:
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    if name.endswith(".kvb"):
                        files.append((st.st_mtime, st.st_size, path))
                    elif name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_SECONDS:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
            total = sum(size for _, size, _ in files)
            evicted = 0
            if total > self.max_bytes:
                files.sort()  # oldest use first
                target = self.max_bytes * LOW_WATER
                while evicted < len(files) and total > target:
                    _, size, path = files[evicted]
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    total -= size
                    evicted += 1
                files = files[evicted:]
        with self._lock:
            self.stats.blocks_on_disk = len(files)
            self.stats.bytes_on_disk = total
            self.stats.evicted_files += evicted

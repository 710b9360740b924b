"""The disk tier's files on their own (no model): what is written is what is read, anything else is
removed and never served, and the directory holds its size bound, least recently used first."""

from __future__ import annotations

import os
import random
import time

import pytest

from kvserve.kv.disk_tier import MAGIC, BlockKey, DiskTier, load_secret
from kvserve.kv.file_framing import KVFileError, pack, unpack

IDENTITY = {"model": "m1", "layout": {"block_size": 4}}
PAYLOAD = 1000


def _key(i: int, parent: int | None = None) -> BlockKey:
    return BlockKey(1000 + i, parent, (i, i + 1, i + 2, i + 3), None)


def _payload(i: int) -> memoryview:
    return memoryview(random.Random(i).randbytes(PAYLOAD))


def _tier(path, max_bytes=1 << 30, identity=IDENTITY) -> DiskTier:
    return DiskTier(path, max_bytes, identity)


def test_written_blocks_read_back_exactly_in_a_new_process_view(tmp_path):
    tier = _tier(tmp_path)
    for i in range(5):
        tier.put(_key(i), _payload(i))
    tier.close()
    again = _tier(tmp_path)  # a restart: nothing in memory, the same directory
    assert again.stats.blocks_on_disk == 5
    for i in range(5):
        assert again.contains(_key(i).block_hash)
        assert bytes(again.read(_key(i), PAYLOAD)) == bytes(_payload(i))
    assert again.stats.blocks_read == 5 and again.stats.rejected_files == 0
    assert not again.contains(_key(9).block_hash) and again.read(_key(9), PAYLOAD) is None
    again.close()


def test_a_queued_block_is_served_before_it_reaches_the_disk(tmp_path, monkeypatch):
    tier = _tier(tmp_path)
    monkeypatch.setattr(tier, "_write", lambda block_hash: None)  # a writer that never gets there
    tier.put(_key(1), _payload(1))
    tier._queue.join()
    assert not tier.path(_key(1).block_hash).exists()
    assert bytes(tier.read(_key(1), PAYLOAD)) == bytes(_payload(1))
    assert tier.read(BlockKey(1001, None, (9, 9, 9, 9), None), PAYLOAD) is None  # same hash, other block
    tier.close()


def _file_of(tier, i):
    return tier.path(_key(i).block_hash)


@pytest.mark.parametrize("damage",
                         ["flip a payload byte", "truncate", "append", "empty", "header says another block",
                                    "another setup's file", "another directory's secret", "other magic"])
def test_damaged_truncated_or_foreign_files_are_removed_not_served(tmp_path, damage):
    tier = _tier(tmp_path / "a")
    tier.put(_key(1), _payload(1))
    tier.put(_key(2), _payload(2))
    tier.close()
    path = _file_of(tier, 1)
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[-100] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "append":
        data += b"\0"
    elif damage == "empty":
        data = bytearray()
    elif damage == "header says another block":  # a valid file of block 2 under block 1's name
        data = bytearray(_file_of(tier, 2).read_bytes())
    elif damage == "another setup's file":  # same key, same secret, written for another model
        other = _tier(tmp_path / "a", identity={**IDENTITY, "model": "m2"})
        other.put(_key(1), _payload(1))
        other.close()
        data = bytearray(_file_of(other, 1).read_bytes())
    elif damage == "another directory's secret":
        stranger = _tier(tmp_path / "b")
        stranger.put(_key(1), _payload(1))
        stranger.close()
        data = bytearray(_file_of(stranger, 1).read_bytes())
    elif damage == "other magic":
        data[:8] = b"GGUF\x03\0\0\0"
    path.write_bytes(bytes(data))

    again = _tier(tmp_path / "a")
    assert again.read(_key(1), PAYLOAD) is None
    assert not path.exists(), "a file that failed its checks must be removed"
    assert again.stats.rejected_files == 1
    assert bytes(again.read(_key(2), PAYLOAD)) == bytes(_payload(2))  # the others are untouched
    again.close()


def test_a_file_of_the_wrong_size_for_this_pool_is_rejected(tmp_path):
    tier = _tier(tmp_path)
    tier.put(_key(1), _payload(1))
    tier.flush()
    assert tier.read(_key(1), PAYLOAD + 16) is None
    assert tier.stats.rejected_files == 1
    tier.close()


def test_size_bound_holds_and_least_recently_used_go_first(tmp_path):
    probe = _tier(tmp_path / "probe")
    probe.put(_key(0), _payload(0))
    probe.close()
    file_size = probe.stats.bytes_on_disk
    bound = 10 * file_size + file_size // 2  # room for 10 files
    tier = _tier(tmp_path / "d", max_bytes=bound)
    for i in range(8):
        tier.put(_key(i), _payload(i))
    tier.flush()
    past = _file_of(tier, 0).stat().st_mtime - 100
    for i in range(8):
        os.utime(_file_of(tier, i), (past + i, past + i))  # written in order 0..7
    assert tier.read(_key(0), PAYLOAD) is not None  # block 0 used again: now the most recent of 0..7
    i = 8
    while tier.stats.evicted_files == 0:  # fill up to the first eviction pass
        tier.put(_key(i), _payload(i))
        tier.flush()
        i += 1
    assert tier.stats.bytes_on_disk <= bound
    assert _file_of(tier, 0).exists()  # recently read: kept
    assert not _file_of(tier, 1).exists()  # least recently used: gone first
    for j in range(i, i + 20):
        tier.put(_key(j), _payload(j))
        tier.flush()
        assert tier.stats.bytes_on_disk <= bound
    on_disk = sum(f.stat().st_size for f in (tmp_path / "d").rglob("*.kvb"))
    assert on_disk <= bound and on_disk == tier.stats.bytes_on_disk
    tier.close()


def test_a_chain_loses_its_tail_first(tmp_path):
    """One request's blocks, written over time (a long prompt's chunks): eviction keeps the chain's
    head (usable alone), not its tail."""
    tier = _tier(tmp_path)
    arrival = time.time() - 5
    chain = [BlockKey(2000 + i, 2000 + i - 1 if i else None, (i,) * 4, None, i, arrival) for i in range(8)]
    for key in chain:
        tier.put(key, _payload(key.index))
        tier.flush()
        time.sleep(0.01)  # later chunks are written later: the file times still follow the chain
    tier.close()
    size = tier.stats.bytes_on_disk // 8
    small = _tier(tmp_path, max_bytes=5 * size)
    kept = [small.path(k.block_hash).exists() for k in chain]
    assert kept == sorted(kept, reverse=True) and 0 < sum(kept) < 8  # a prefix of the chain survives
    small.close()


def test_a_prefix_found_again_is_kept_over_older_ones(tmp_path):
    tier = _tier(tmp_path)
    old = [BlockKey(3000 + i, None, (i,) * 4, None, i, time.time() - 100) for i in range(4)]
    new = [BlockKey(4000 + i, None, (i,) * 4, None, i, time.time() - 50) for i in range(4)]
    for key in old + new:
        tier.put(key, _payload(key.index))
    tier.flush()
    tier.touch([k.block_hash for k in old])  # a request was admitted with the old chain as its prefix
    tier.close()
    size = tier.stats.bytes_on_disk // 8
    small = _tier(tmp_path, max_bytes=5 * size)
    assert all(small.path(k.block_hash).exists() for k in old)
    assert not small.path(new[-1].block_hash).exists()
    small.close()


def test_a_smaller_bound_at_start_trims_the_directory(tmp_path):
    tier = _tier(tmp_path)
    for i in range(6):
        tier.put(_key(i), _payload(i))
    tier.close()
    small = _tier(tmp_path, max_bytes=2 * tier.stats.bytes_on_disk // 6)
    assert small.stats.bytes_on_disk <= small.max_bytes
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.kvb")) <= small.max_bytes
    small.close()


def test_secret_is_created_once_private_and_shared(tmp_path):
    a = load_secret(tmp_path)
    assert load_secret(tmp_path) == a and len(a) == 32
    assert (tmp_path / "secret").stat().st_mode & 0o077 == 0
    (tmp_path / "secret").write_bytes(b"short")  # damaged: replaced, not trusted
    assert load_secret(tmp_path) != a


def test_kv_file_framing_rejects_every_truncation():
    header = {"a": 1}
    data = b"".join(bytes(p) for p in pack(MAGIC, header, b"x" * 50, b"k" * 32))
    assert unpack(data, MAGIC, b"k" * 32)[0]["a"] == 1
    for n in range(len(data)):
        with pytest.raises(KVFileError):
            unpack(data[:n], MAGIC, b"k" * 32)
    with pytest.raises(KVFileError):
        unpack(data, MAGIC, b"j" * 32)

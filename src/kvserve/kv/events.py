"""KV cache events: what the prefix cache gained and lost, for routers that track it from outside
(llm-d's KV indexer, Dynamo's KV router).

The pool records events into a list while a step runs (no I/O, no encoding); the engine hands the
list to a sink after the step (``server.kv_events`` publishes it). Three kinds, as vLLM has them:

    BlockStored        blocks registered in the prefix cache: consecutive blocks of one chain are
                       one event (hashes in order, the first one's parent, all their token ids)
    BlockRemoved       blocks that left the prefix cache (evicted for reuse, or uncached)
    AllBlocksCleared   the prefix cache is empty (a reset that left nothing cached)

Replaying the events in order rebuilds the set of cached hashes exactly (see ``wire_hash``).
``to_wire`` gives each event as vLLM's msgspec encoder writes its tagged ``array_like`` structs: a
list whose first element is the tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.hashing import BlockHash

_LOW_64 = (1 << 64) - 1


def wire_hash(block_hash: BlockHash) -> int:
    """The hash a router sees: the low 64 bits of our 128-bit hash, as an unsigned integer.

    msgpack integers stop at 64 bits, and the consumers decode vLLM's default, an integer hash
    (llm-d also takes bytes, Dynamo's relay only integers). 64 bits of a keyed BLAKE2b digest keep
    collisions out of reach (~2^-64 per pair) for what is only a routing hint: the pool itself
    checks the whole 128-bit hash, the tokens and the parent before serving a block."""
    return block_hash & _LOW_64


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # the block before the first one; None: a chain's first block
    token_ids: list[int]  # block_size tokens per block, in order
    block_size: int
    medium: str

    def to_wire(self) -> list:
        parent = None if self.parent_block_hash is None else wire_hash(self.parent_block_hash)
        # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
        return ["BlockStored", [wire_hash(h) for h in self.block_hashes], parent, list(self.token_ids),
                self.block_size, None, self.medium, None]


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str

    def to_wire(self) -> list:
        return ["BlockRemoved", [wire_hash(h) for h in self.block_hashes], self.medium]


@dataclass(slots=True)
class AllBlocksCleared:
    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """The pool's pending events. Consecutive stores continuing one chain, and consecutive removals,
    are merged into one event each, as vLLM batches them."""

    medium: str = "CPU"  # where the pool lives: vLLM says "GPU" for device memory, "CPU" for host
    events: list[KVEvent] = field(default_factory=list)

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None,
               token_ids: tuple[int, ...]) -> None:
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash
                and last.block_size == len(token_ids)):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([block_hash], parent_hash, list(token_ids), len(token_ids),
                                       self.medium))

    def removed(self, block_hash: BlockHash) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events = [AllBlocksCleared()]  # what came before no longer matters to a subscriber

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

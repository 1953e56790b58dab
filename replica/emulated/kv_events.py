"""KV cache events of the emulated engine, as plain data (vLLM's names and meanings).

The HTTP replica turns them into vLLM's msgpack wire format (``publisher.py``); the fleet simulator
feeds them straight to the router's index.  Hashes are the block hashes the engine was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """Full blocks newly cached, in chain order; ``parent_block_hash`` precedes the first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # the blocks' tokens (len = block_size * len(block_hashes)), or [] if unknown
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks evicted (a free block reused for new content)."""

    block_hashes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

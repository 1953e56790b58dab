"""The prefix index: which replica holds which block of a chain (docs/design.md §3).

An entry (block hash, replica) is either *predicted* (the router sent that prompt there) or
*confirmed* (the engine's KV events said it stored the block).  A predicted entry on a replica that
publishes KV events expires after ``predicted_ttl_s`` unless confirmed, since the truth arrives
soon; on a replica without events it lives until the capacity bound evicts it, or affinity would be
lost.  Each replica's predictions are capped at its KV capacity in blocks, and apart from them
its confirmed entries too (least recently used go first in each): a prediction never evicts a
block the engine said it stores (its BlockRemoved says when that goes), and confirmed entries
past what the engine can hold are stale (lost events).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaSpec:
    """What the index must know of a replica."""

    name: str
    capacity_blocks: int
    publishes_events: bool = False


class PrefixIndex(abc.ABC):
    """One interface, two backends (memory for one router, Redis for several).

    The router calls a backend through ``IndexClient`` (router/index/client.py), which adds
    timeouts, error counting, writes behind the answer and the rebuild after a Redis restart.
    """

    @abc.abstractmethod
    async def add_replica(self, spec: ReplicaSpec) -> None:
        """Register or update a replica's capacity and event mode (idempotent)."""

    @abc.abstractmethod
    async def remove_replica(self, name: str) -> None:
        """Forget a replica and drop all of its entries."""

    @abc.abstractmethod
    async def lookup(self, chain: Sequence[int]) -> dict[str, int]:
        """For each replica holding the chain's first block: how many leading blocks it holds.

        Replicas holding none are absent.  One Redis round trip at most.
        """

    @abc.abstractmethod
    async def record_prediction(self, replica: str, chain: Sequence[int]) -> bool:
        """The router sent this chain to ``replica``: predict it holds every block.

        False: the replica is not registered, nothing was written.
        """

    @abc.abstractmethod
    async def confirm(self, replica: str, hashes: Sequence[int]) -> bool:
        """KV event BlockStored: the replica holds these blocks until told otherwise.

        False: the replica is not registered, nothing was written.
        """

    @abc.abstractmethod
    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        """KV event BlockRemoved: the replica no longer holds these blocks."""

    @abc.abstractmethod
    async def clear_replica(self, name: str) -> None:
        """KV event AllBlocksCleared (or a restart): drop the replica's entries, keep the replica."""

    @abc.abstractmethod
    async def drop_confirmed(self, name: str) -> None:
        """Lost KV events with no replay: forget what events confirmed, keep predictions."""

    @abc.abstractmethod
    async def entry_count(self, name: str) -> int:
        """Live entries held for a replica (predicted and confirmed)."""

    async def refresh(self, replicas: Sequence[str], token: str) -> str | None:
        """A shared store: keep the keys of ``replicas`` alive and return the store's epoch, which
        is ``token`` if the store had none (new, restarted empty or flushed).  A backend in this
        process has nothing to lose: None."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

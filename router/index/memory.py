"""In-memory prefix index, for a single router (and the simulator, on a virtual clock)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from .base import PrefixIndex, ReplicaSpec

# An entry's value is its expiry time; these two mark entries that never expire.
CONFIRMED = -1.0
PINNED = math.inf  # predicted, on a replica without KV events


class _Replica:
    __slots__ = ("spec", "lru", "expiries")

    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        self.lru: OrderedDict[int, None] = OrderedDict()  # block hash, least recent first
        self.expiries: deque[tuple[float, int]] = deque()  # (expiry, hash) of TTL predictions


class MemoryIndex(PrefixIndex):
    def __init__(self, predicted_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.predicted_ttl_s = predicted_ttl_s
        self.clock = clock
        self._blocks: dict[int, dict[str, float]] = {}  # hash -> replica -> expiry
        self._replicas: dict[str, _Replica] = {}

    # -- replicas -------------------------------------------------------------------------
    async def add_replica(self, spec: ReplicaSpec) -> None:
        rep = self._replicas.get(spec.name)
        if rep is None:
            self._replicas[spec.name] = _Replica(spec)
            return
        rep.spec = spec
        self._expire(rep, self.clock())
        self._evict_over_capacity(rep)

    async def remove_replica(self, name: str) -> None:
        await self.clear_replica(name)
        self._replicas.pop(name, None)

    async def clear_replica(self, name: str) -> None:
        rep = self._replicas.get(name)
        if rep is None:
            return
        for h in rep.lru:
            self._drop(h, name)
        rep.lru.clear()
        rep.expiries.clear()

    async def drop_confirmed(self, name: str) -> None:
        rep = self._replicas.get(name)
        if rep is None:
            return
        gone = [h for h in rep.lru if self._blocks.get(h, {}).get(name) == CONFIRMED]
        for h in gone:
            del rep.lru[h]
            self._drop(h, name)

    async def entry_count(self, name: str) -> int:
        rep = self._replicas.get(name)
        if rep is None:
            return 0
        self._expire(rep, self.clock())
        return len(rep.lru)

    # -- lookups --------------------------------------------------------------------------
    async def lookup(self, chain: Sequence[int]) -> dict[str, int]:
        now = self.clock()
        blocks = self._blocks
        matched: dict[str, int] = {}
        alive: list[str] = []
        for depth, h in enumerate(chain):
            holders = blocks.get(h)
            if holders is None:
                break
            if depth == 0:
                alive = [r for r, exp in holders.items() if exp == CONFIRMED or exp > now]
            else:
                still = []
                for r in alive:
                    exp = holders.get(r)
                    if exp is not None and (exp == CONFIRMED or exp > now):
                        still.append(r)
                    else:
                        matched[r] = depth
                alive = still
            if not alive:
                return matched
        else:
            depth = len(chain)
        for r in alive:  # the ones that matched to the end (or to the first unknown block)
            matched[r] = depth
        return matched

    # -- writes ---------------------------------------------------------------------------
    async def record_prediction(self, replica: str, chain: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None or not chain:
            return
        now = self.clock()
        self._expire(rep, now)
        expiry = now + self.predicted_ttl_s if rep.spec.publishes_events else PINNED
        self._write(rep, chain, expiry)

    async def confirm(self, replica: str, hashes: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        self._expire(rep, self.clock())  # expired predictions must not take capacity
        self._write(rep, hashes, CONFIRMED)

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        for h in hashes:
            if h in rep.lru:
                del rep.lru[h]
                self._drop(h, replica)

    # -- internals ------------------------------------------------------------------------
    def _write(self, rep: _Replica, hashes: Sequence[int], expiry: float) -> None:
        """Set entries (a confirmation is never downgraded to a prediction) and touch the LRU.

        Walks the chain backwards so that its head ends up most recently used: capacity
        eviction then takes tails first, as the engine's own free queue does, instead of
        the shared head that every longer prefix depends on.
        """
        blocks, lru, name = self._blocks, rep.lru, rep.spec.name
        move = lru.move_to_end
        timed = expiry != PINNED and expiry != CONFIRMED
        expiries = rep.expiries
        for h in reversed(hashes):
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {name: expiry}
            elif expiry == CONFIRMED or holders.get(name) != CONFIRMED:
                holders[name] = expiry
            else:
                move(h)  # confirmed already: only refresh its recency
                continue
            if timed:
                expiries.append((expiry, h))
            if h in lru:
                move(h)
            else:
                lru[h] = None
        self._evict_over_capacity(rep)

    def _drop(self, h: int, replica: str) -> None:
        holders = self._blocks.get(h)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._blocks[h]

    def _evict_over_capacity(self, rep: _Replica) -> None:
        lru = rep.lru
        over = len(lru) - max(rep.spec.capacity_blocks, 0)
        for _ in range(over):
            h, _ = lru.popitem(last=False)
            self._drop(h, rep.spec.name)

    def _expire(self, rep: _Replica, now: float) -> None:
        """Drop TTL predictions that ran out (and were neither confirmed nor renewed)."""
        q = rep.expiries
        name = rep.spec.name
        while q and q[0][0] <= now:
            expiry, h = q.popleft()
            holders = self._blocks.get(h)
            if holders is not None and holders.get(name) == expiry:
                rep.lru.pop(h, None)
                self._drop(h, name)

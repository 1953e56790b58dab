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
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        depth = 0
        for h in chain:
            holders = self._blocks.get(h)
            if not holders:
                break
            if alive is None:
                alive = {r for r, exp in holders.items() if exp == CONFIRMED or exp > now}
            else:
                alive = {r for r in alive if (exp := holders.get(r)) is not None and (exp == CONFIRMED or exp > now)}
            if not alive:
                break
            depth += 1
            for r in alive:
                matched[r] = depth
        return matched

    # -- writes ---------------------------------------------------------------------------
    async def record_prediction(self, replica: str, chain: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None or not chain:
            return
        now = self.clock()
        self._expire(rep, now)
        if rep.spec.publishes_events:
            expiry = now + self.predicted_ttl_s
        else:
            expiry = PINNED
        for h in chain:
            holders = self._blocks.setdefault(h, {})
            if holders.get(replica) != CONFIRMED:
                holders[replica] = expiry
                if expiry != PINNED:
                    rep.expiries.append((expiry, h))
            self._touch(rep, h)
        self._evict_over_capacity(rep)

    async def confirm(self, replica: str, hashes: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        for h in hashes:
            self._blocks.setdefault(h, {})[replica] = CONFIRMED
            self._touch(rep, h)
        self._evict_over_capacity(rep)

    async def remove(self, replica: str, hashes: Sequence[int]) -> None:
        rep = self._replicas.get(replica)
        if rep is None:
            return
        for h in hashes:
            if h in rep.lru:
                del rep.lru[h]
                self._drop(h, replica)

    # -- internals ------------------------------------------------------------------------
    @staticmethod
    def _touch(rep: _Replica, h: int) -> None:
        lru = rep.lru
        if h in lru:
            lru.move_to_end(h)
        else:
            lru[h] = None

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

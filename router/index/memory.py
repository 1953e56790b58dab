"""In-memory prefix index, for a single router (and the simulator, on a virtual clock).

Each replica keeps one ordered map, block hash -> expiry, least recently used first: it is the
LRU and the entry store at once, so a write touches one dict per block, and a lookup reads a
replica's whole run with ``map(entries.get, chain)`` (a C loop) and finds where it ends with list
methods, also C, instead of walking the chain block by block in Python.  Fleets have a handful to
a few hundred replicas, and each one not holding the chain's head costs one ``get``.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import repeat

from .base import PrefixIndex, ReplicaSpec

# An entry's value is its expiry time; these two mark entries that never expire.
CONFIRMED = -1.0
PINNED = math.inf  # predicted, on a replica without KV events
ABSENT = 0.0  # what a lookup reads for a block not held: an expiry long past, so never live


class _Replica:
    __slots__ = ("spec", "entries", "expiries")

    def __init__(self, spec: ReplicaSpec):
        self.spec = spec
        self.entries: OrderedDict[int, float] = OrderedDict()  # block hash -> expiry, least recent first
        self.expiries: deque[tuple[float, int]] = deque()  # (expiry, hash) of TTL predictions


def _live(expiry: float, now: float) -> bool:
    return expiry == CONFIRMED or expiry > now


def _live_run(expiries: list[float], now: float) -> int:
    """Length of the leading run of live entries (ABSENT where a block is not held); the first is live."""
    first = expiries[0]
    n = len(expiries)
    if expiries.count(first) == n:
        return n  # all one value (pinned, confirmed, or one prediction), and the head is live
    # A float list searched for a float stays on the fast path (no None comparisons).  One write
    # gives a whole chain the same expiry, so there are few distinct values to check.
    held = expiries.index(ABSENT) if ABSENT in expiries else n
    expiries = expiries[:held]
    dead = [e for e in set(expiries) if not _live(e, now)]
    return min(map(expiries.index, dead)) if dead else held


def _run_bound(entries: dict[int, float], chain: Sequence[int], now: float) -> int:
    """A length the leading live run cannot exceed: the position of the first of blocks 8, 16,
    32, ... found not live, else the whole chain.  Replicas that share only a chain's head (a common system
    prompt) then cost a few lookups instead of one per block of the chain."""
    n = len(chain)
    probe = 8
    while probe < n:
        expiry = entries.get(chain[probe], ABSENT)
        if not _live(expiry, now):
            return probe
        probe *= 2
    return n


class MemoryIndex(PrefixIndex):
    in_process = True

    def __init__(self, predicted_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.predicted_ttl_s = predicted_ttl_s
        self.clock = clock
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
        self._replicas.pop(name, None)

    async def clear_replica(self, name: str) -> None:
        rep = self._replicas.get(name)
        if rep is None:
            return
        rep.entries.clear()
        rep.expiries.clear()

    async def drop_confirmed(self, name: str) -> None:
        rep = self._replicas.get(name)
        if rep is None:
            return
        entries = rep.entries
        for h in [h for h, expiry in entries.items() if expiry == CONFIRMED]:
            del entries[h]

    async def entry_count(self, name: str) -> int:
        rep = self._replicas.get(name)
        if rep is None:
            return 0
        self._expire(rep, self.clock())
        return len(rep.entries)

    # -- lookups --------------------------------------------------------------------------
    async def lookup(self, chain: Sequence[int]) -> dict[str, int]:
        return self.lookup_now(chain)

    def lookup_now(self, chain: Sequence[int]) -> dict[str, int]:
        if not chain:
            return {}
        now = self.clock()
        head = chain[0]
        matched: dict[str, int] = {}
        for name, rep in self._replicas.items():
            first = rep.entries.get(head)
            if first is not None and _live(first, now):
                end = _run_bound(rep.entries, chain, now)
                matched[name] = _live_run(list(map(rep.entries.get, chain[:end], repeat(ABSENT))), now)
        return matched

    # -- writes ---------------------------------------------------------------------------
    async def record_prediction(self, replica: str, chain: Sequence[int]) -> None:
        self.record_prediction_now(replica, chain)

    def record_prediction_now(self, replica: str, chain: Sequence[int]) -> None:
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
            rep.entries.pop(h, None)

    # -- internals ------------------------------------------------------------------------
    def _write(self, rep: _Replica, hashes: Sequence[int], expiry: float) -> None:
        """Set entries (a confirmation is never downgraded to a prediction) and touch the LRU.

        The chain is touched backwards so that its head ends up most recently used: capacity
        eviction then takes tails first, as the engine's own free queue does, instead of the
        shared head that every longer prefix depends on.  Values are set first and the recency
        moves done after, in one C loop: setting a value never moves a key, so the resulting order
        is the same as touching block by block, and most blocks of a chain seen before (the
        earlier turns of a conversation) need no new value at all.
        """
        entries = rep.entries
        old = list(map(entries.get, hashes))
        timed = expiry != PINNED and expiry != CONFIRMED
        if timed or old.count(expiry) + (expiry != CONFIRMED and old.count(CONFIRMED)) != len(old):
            self._set_values(rep, hashes, old, expiry, timed)
        # deque(maxlen=0) consumes the map in C
        deque(map(entries.move_to_end, reversed(hashes)), maxlen=0)
        self._evict_over_capacity(rep)

    @staticmethod
    def _set_values(rep: _Replica, hashes: Sequence[int], old: list[float | None], expiry: float, timed: bool) -> None:
        entries, expiries = rep.entries, rep.expiries
        for h, was in zip(reversed(hashes), reversed(old)):
            if was == CONFIRMED and expiry != CONFIRMED:
                continue  # confirmed already: only its recency is refreshed
            if was == expiry and not timed:
                continue
            entries[h] = expiry
            if timed:
                expiries.append((expiry, h))

    def _evict_over_capacity(self, rep: _Replica) -> None:
        entries = rep.entries
        for _ in range(len(entries) - max(rep.spec.capacity_blocks, 0)):
            entries.popitem(last=False)

    def _expire(self, rep: _Replica, now: float) -> None:
        """Drop TTL predictions that ran out (and were neither confirmed nor renewed)."""
        q = rep.expiries
        entries = rep.entries
        while q and q[0][0] <= now:
            expiry, h = q.popleft()
            if entries.get(h) == expiry:
                del entries[h]

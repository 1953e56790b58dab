"""The prefix index's contract as an executable model: what every backend must answer.

``MemoryIndex`` and ``RedisIndex`` are fast; this is plain.  tests/test_index_contract.py runs
random operation sequences against a backend and this model and compares every answer, so this
module is the index's specification (docs/design.md describes it in words):

- an entry (block, replica) is *predicted* (expires ``ttl`` after its last write on a replica that
  publishes KV events, never on one that does not) or *confirmed* (until removed or cleared; a
  prediction never downgrades a confirmed entry);
- each replica holds at most ``capacity_blocks`` live predictions and, apart, at most
  ``capacity_blocks`` confirmed entries (more than the engine can hold are stale: lost events),
  each class's least recently written evicted first, expired ones purged before anything live is
  evicted: a prediction never evicts a confirmed entry; a chain written at once counts its head
  as the most recent;
- a lookup counts, per replica, the chain's leading blocks it holds live, stopping at the first
  gap; writes for an unregistered replica are ignored.
"""

from __future__ import annotations

from collections import OrderedDict

from kvroute.router.index.base import ReplicaSpec


class ReferenceIndex:
    """The contract, written as plainly as possible: per replica, an ordered map hash -> state
    (``None``: confirmed; a number: a prediction's expiry, ``inf`` on a replica without events),
    least recently written first."""

    CONFIRMED = None

    def __init__(self, ttl: float) -> None:
        self.ttl, self.now = ttl, 0.0
        self.specs: dict[str, ReplicaSpec] = {}
        self.entries: dict[str, OrderedDict[int, float | None]] = {}

    def _live(self, expiry: float | None) -> bool:
        return expiry is self.CONFIRMED or expiry > self.now

    def _purge_and_fit(self, name: str) -> None:
        entries = self.entries[name]
        for h in [h for h, e in entries.items() if not self._live(e)]:
            del entries[h]
        capacity = max(self.specs[name].capacity_blocks, 0)
        for confirmed in (False, True):
            held = [h for h, e in entries.items() if (e is self.CONFIRMED) == confirmed]  # least recent first
            for h in held[: max(len(held) - capacity, 0)]:
                del entries[h]

    def add_replica(self, s: ReplicaSpec) -> None:
        self.specs[s.name] = s
        self.entries.setdefault(s.name, OrderedDict())
        self._purge_and_fit(s.name)

    def remove_replica(self, name: str) -> None:
        self.specs.pop(name, None)
        self.entries.pop(name, None)

    def write(self, name: str, hashes: list[int], confirmed: bool) -> None:
        if name not in self.specs:
            return
        self._purge_and_fit(name)  # expired entries go before anything is evicted
        entries = self.entries[name]
        for h in reversed(hashes):  # the head ends up most recent
            if confirmed:
                entries[h] = self.CONFIRMED
            elif h not in entries or entries[h] is not self.CONFIRMED:
                entries[h] = self.now + self.ttl if self.specs[name].publishes_events else float("inf")
            entries.move_to_end(h)
        self._purge_and_fit(name)

    def remove(self, name: str, hashes: list[int]) -> None:
        for h in hashes:
            self.entries.get(name, {}).pop(h, None)

    def clear_replica(self, name: str) -> None:
        self.entries.get(name, OrderedDict()).clear()

    def drop_confirmed(self, name: str) -> None:
        entries = self.entries.get(name, {})
        for h in [h for h, e in entries.items() if e is self.CONFIRMED]:
            del entries[h]

    def entry_count(self, name: str) -> int:
        return sum(self._live(e) for e in self.entries.get(name, {}).values())

    def lookup(self, chain: list[int]) -> dict[str, int]:
        out = {}
        for name, entries in self.entries.items():
            depth = 0
            while depth < len(chain) and chain[depth] in entries and self._live(entries[chain[depth]]):
                depth += 1
            if depth:
                out[name] = depth
        return out

"""Weighted fair queueing across tenants, strict priority across classes: which queued request goes next,
and which goes first when the queue must shed.

Start-time fair queueing: a request of tenant t arriving at virtual time V is tagged
``start = max(V, finish[t])``, ``finish = start + 1 / weight[t]`` (one request costs 1; a tenant of
weight 2 gets twice the share), and V becomes the start tag of each request served.  A tenant
sending 10x another's rate piles up finish tags 10x faster, so the other's requests sort in front
of its backlog; one that was idle starts at V with no debt and no credit.  The order is
(priority class, finish tag): a higher class is always served first, and the last entry, the
lowest class's largest finish tag (the heaviest tenant's latest request), is the one shed.  When
the queue empties, V jumps to the largest finish tag handed out and every tenant's tag is
forgotten: a new busy period starts even (design.md §7.6).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_TENANTS = 4096  # tenants' tags held before those with no backlog are dropped


@dataclass(eq=False, slots=True)
class Queued:
    """One waiting request: its tenant, class and tags, and what it waits on (the caller's)."""

    tenant: str
    priority: int
    start: float = 0.0
    finish: float = 0.0
    seq: int = 0
    waiter: Any = field(default=None, repr=False)

    @property
    def key(self) -> tuple[int, float, int]:
        return (self.priority, self.finish, self.seq)


class FairQueue:
    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights = dict(weights or {})
        self._entries: list[Queued] = []  # sorted by key; short (bounded by the caller): a list is enough
        self._keys: list[tuple[int, float, int]] = []
        self._finish: dict[str, float] = {}  # tenant -> its last finish tag in this busy period
        self._vtime = 0.0
        self._max_finish = 0.0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, entry: Queued) -> int:
        """Tag ``entry`` and queue it; its position (0: next)."""
        entry.start = max(self._vtime, self._finish.get(entry.tenant, 0.0))
        entry.finish = entry.start + 1.0 / self.weights.get(entry.tenant, 1.0)
        entry.seq = next(self._seq)
        self._finish[entry.tenant] = entry.finish
        if len(self._finish) > MAX_TENANTS:  # tenants already caught up with V owe nothing: forget them
            self._finish = {t: f for t, f in self._finish.items() if f > self._vtime}
        self._max_finish = max(self._max_finish, entry.finish)
        key = entry.key
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._entries.insert(at, entry)
        return at

    def pop(self) -> Queued:
        """The next to serve: the highest class's smallest finish tag."""
        entry = self._entries[0]
        self.take(entry)
        return entry

    def first(self, may_go: Callable[[Queued], bool], scan: int) -> Queued | None:
        """The first of the next ``scan`` entries, in order, that ``may_go`` (room for its tenant)."""
        for entry in self._entries[:scan]:
            if may_go(entry):
                return entry
        return None

    def take(self, entry: Queued) -> None:
        """Serve ``entry`` (from :meth:`first`): out of the queue, V at its start tag."""
        self.remove(entry)
        self._vtime = max(self._vtime, entry.start)

    def last(self) -> Queued | None:
        """The first to shed: the lowest class's largest finish tag."""
        return self._entries[-1] if self._entries else None

    def remove(self, entry: Queued) -> bool:
        """Take ``entry`` out (it timed out, was shed, its client left); False if it is not queued."""
        at = bisect.bisect_left(self._keys, entry.key)
        if at < len(self._entries) and self._entries[at] is entry:
            del self._entries[at], self._keys[at]
            self._settle()
            return True
        return False

    def _settle(self) -> None:
        if not self._entries:  # idle: the next busy period starts even
            self._vtime = max(self._vtime, self._max_finish)
            self._finish.clear()

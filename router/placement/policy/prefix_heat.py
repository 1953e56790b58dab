"""Which prefixes carry more traffic than their copies serve at a fair share (docs/design.md §5.7).

Request counts per prefix key and for the whole fleet decay over time on the caller's clock
(``Query.now``) with time constant ``tau_s``: a share is evidence of *sustained* traffic,
so one busy moment moves nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict


class PrefixHeat:
    """Decayed request counts per prefix key and for the whole fleet (``max_keys`` kept, LRU).

    The cost model's key for a request is the last block of the longest prefix some replica
    holds: the prefix the request would reuse."""

    def __init__(self, tau_s: float, max_keys: int):
        self.tau_s = tau_s
        self.max_keys = max_keys
        self._keys: OrderedDict[int, tuple[float, float]] = OrderedDict()  # key -> (count, at)
        self._total = 0.0
        self._total_at = 0.0

    def _decayed(self, count: float, at: float, now: float) -> float:
        return count * math.exp(-max(0.0, now - at) / self.tau_s)

    def share(self, key: int, now: float) -> float:
        """Share of the recent requests that carried ``key`` (0 if never seen)."""
        entry = self._keys.get(key)
        total = self._decayed(self._total, self._total_at, now)
        if entry is None or total <= 0:
            return 0.0
        return min(1.0, self._decayed(*entry, now) / total)

    def record(self, key: int | None, now: float) -> None:
        self._total = self._decayed(self._total, self._total_at, now) + 1.0
        self._total_at = now
        if key is None:
            return
        entry = self._keys.pop(key, None)
        count = self._decayed(*entry, now) if entry is not None else 0.0
        self._keys[key] = (count + 1.0, now)
        if len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

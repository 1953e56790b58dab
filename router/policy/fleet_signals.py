"""What the cost model learns about the fleet across decisions: how much of a prompt is usually
found cached, and which prefixes carry more traffic than their copies serve at a fair share.

All three are averages over time on the caller's clock (``RouteRequest.now``), with time constant
``tau_s``: evidence of *sustained* conditions, so that one busy moment moves nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from .base import RouteRequest


class Decay:
    """A value averaged over time: ``update(x, now)`` moves it towards ``x`` by 1 - exp(-dt/tau)."""

    def __init__(self, tau_s: float, value: float = 0.0):
        self.tau_s = tau_s
        self.value = value
        self._at: float | None = None

    def update(self, x: float, now: float) -> float:
        a = 1.0 if self._at is None else 1.0 - math.exp(-max(0.0, now - self._at) / self.tau_s)
        self._at = now
        self.value += a * (x - self.value)
        return self.value


class PrefixHeat:
    """Decayed request counts per prefix key and for the whole fleet (``max_keys`` kept, LRU)."""

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


class FleetSignals:
    def __init__(self, tau_s: float, max_keys: int):
        self.reuse = Decay(tau_s)  # share of a prompt's tokens some replica held
        self.heat = PrefixHeat(tau_s, max_keys)

    def observe(self, req: RouteRequest) -> None:
        held = max(req.matches.values(), default=0)
        if req.prompt_tokens > 0:
            self.reuse.update(min(1.0, held * req.block_size / req.prompt_tokens), req.now)

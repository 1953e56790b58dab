"""Room kept for the others: while several tenants send, the last few admission slots go only to a
tenant holding less than its fair share of them.

Fair order (fair_queue.py) decides who gets the next slot to free, not when one frees: a light
tenant's request that finds every slot held by a heavy tenant waits for one to end, up to a whole
service time (and requests of one length admitted together end together, in waves), which raised
the light tenant's p99 well past the 20 % issue 20 allows (docs/experiments.md, 2026-12-05, room
kept for the others).  So a tenant already holding its fair share of the limit (the limit split
by weight among the tenants seen in the last ``RECENT_S``) takes a slot only while more than the
reserve are free, and a request of a tenant under its share finds one at once.  With one tenant
sending, or below the limit, nothing is kept.  The price: the kept slots idle while the heavy
tenant's requests wait for them, ``--fair-slot-reserve`` of the limit (1/16, at least one slot
from ``MIN_LIMIT``), so a router saturated by slots serves that much less while several tenants
send (design.md §7.6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

RECENT_S = 5.0  # a tenant seen this recently counts among those the slots are shared with
RESERVE_FRACTION = 1 / 16  # the default of --fair-slot-reserve
MIN_LIMIT = 4  # below this many slots nothing is kept (one of two or three is too dear)
COUNT_EVERY_S = 0.05
MAX_SEEN = 4096  # tenants remembered at most; past it those not seen within RECENT_S are dropped


def reserve_of(limit: int, fraction: float = RESERVE_FRACTION) -> int:
    """Slots kept for tenants under their share at this admission limit."""
    return max(1, math.floor(limit * fraction)) if limit >= MIN_LIMIT and fraction > 0 else 0


class SlotShares:
    """Who holds how many slots, who sent lately, and whether a tenant may take one more."""

    def __init__(self, weights: Mapping[str, float] | None = None, fraction: float = RESERVE_FRACTION):
        self.weights = dict(weights or {})
        self.fraction = fraction
        self.held: dict[str, int] = {}  # tenant -> slots held now
        self._seen: dict[str, float] = {}  # tenant -> when it last sent (monotonic)
        self._counted_at = -math.inf
        self._recent, self._recent_weight = 0, 0.0  # tenants seen within RECENT_S, their summed weight

    def saw(self, tenant: str, now: float) -> None:
        self._seen[tenant] = now
        if len(self._seen) > MAX_SEEN:
            self._seen = {t: at for t, at in self._seen.items() if at > now - RECENT_S}

    def took(self, tenant: str) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def gave_back(self, tenant: str) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)

    def may_take(self, tenant: str, in_flight: int, limit: int, now: float) -> bool:
        """Whether ``tenant`` may take a slot with ``in_flight`` of ``limit`` taken."""
        if in_flight >= limit:
            return False
        reserve = reserve_of(limit, self.fraction)
        if limit - in_flight > reserve:
            return True
        if now - self._counted_at > COUNT_EVERY_S:  # at most once a tick: tenants seen lately, their weight
            recent = [t for t, at in self._seen.items() if at > now - RECENT_S]
            self._recent, self._recent_weight = len(recent), sum(self.weights.get(t, 1.0) for t in recent)
            self._counted_at = now
        if self._recent < 2:
            return True
        share = limit * self.weights.get(tenant, 1.0) / self._recent_weight
        return self.held.get(tenant, 0) < share

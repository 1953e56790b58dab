"""Fair shares of a router short of CPU: while it is, each tenant may send its share of what the
router serves, and what a tenant sends beyond its share is refused at the door (door.py).

Short of CPU, not of slots, a router reads requests late: they wait in the kernel (the accept
queue, the sockets' buffers) where the admission queue's fair order cannot act, so every tenant
waits alike, and refusing what arrives late refuses every tenant in proportion to what it sends
(docs/experiments.md, 2026-12-05).  The excess has to be refused before it costs, and by tenant:

- *Short of CPU* (``Saturation.short_of_cpu``): the accept queue long (more than 64 connections
  on two ticks, more than 16 on one while the shares are on), or requests read late (the least
  kernel wait of a tick over ``saturation.STANDING_WAIT_S`` on two ticks in a row: CoDel's standing queue,
  not one burst).  Not the loop's lag nor the tokenizer pool: a closed loop of clients saturates
  both at the router's capacity, and refusing it gains nothing.
- *A rate for the whole router*: when it becomes short, the rate requests finished at (smoothed
  over a quarter of a second) less 10 %.  While it stays short and the kernel's queue does not shrink,
  ``DECREASE`` times the lesser of the rate and what is served now (so that it binds at once: a
  router behind reads fewer requests than come, and a rate above what it reads limits nobody);
  held while the queue shrinks (lower, it would leave the router idle once the queue is gone);
  raised by ``INCREASE`` a tick once it is not short, to at most ``HEADROOM`` times what is served
  (a rate far above what the router showed it can serve lets the next burst in whole); never
  below ``FLOOR`` of the rate it started from, so that a shortage the refusals cannot cure
  (another process on the core) throttles nobody to nothing.  The shares end after
  ``CALM_TICKS`` ticks not short with the rate above what all tenants send.
- *Shares*: that rate split max-min fair (weighted by ``tenant_weights``) over the tenants'
  measured rates (:func:`fair_shares`): a tenant sending less than its share is never refused; one
  sending more gets a token bucket filled at its share, and a request that finds it empty is
  refused at once, a few microseconds of work instead of the milliseconds of serving it.

Priority classes are not consulted: they order requests within a tenant's share in the admission
queue; a share is per tenant so that no header can buy more of it (design.md §7.6).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("kvroute.router")

DECREASE = 0.95  # per tick while short of CPU: halves the rate in ~0.7 s
INCREASE = 1.05  # per tick once not: doubles it in ~0.7 s (a rate left low serves less than it could)
START = 0.9  # of the throughput measured when the router became short
FLOOR = 0.1  # of the starting rate
HEADROOM = 1.1  # the rate climbs to at most this much over what is served (no credit for CPU not shown)
CALM_TICKS = 20  # the shares end after this many ticks not short, with nobody over its share
RATE_SMOOTHING = 0.3  # weight of a tick's count in a tenant's rate (a time constant of ~3 ticks)
BURST_S = 0.1  # a tenant's bucket holds this long of its share (at least one request)
FORGET_RATE = 0.5  # a tenant sending less (req/s) is forgotten
MAX_TENANTS = 10_000  # tenants followed at most; past it the one sending least is forgotten


def fair_shares(rates: Mapping[str, float], total: float, weights: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair split of ``total`` (req/s) over tenants sending ``rates``, weighted: a tenant
    sending no more than its share keeps all it sends (and is left out of the result); the others
    split what is left by weight (water filling).  Returns the share of each tenant that sends more."""
    def weight(tenant: str) -> float:
        return weights.get(tenant, 1.0)

    order = sorted(rates, key=lambda t: rates[t] / weight(t))
    left, weight_left = total, sum(weight(t) for t in order)
    for i, tenant in enumerate(order):
        per_weight = left / weight_left
        if rates[tenant] > per_weight * weight(tenant):
            return {t: per_weight * weight(t) for t in order[i:]}
        left -= rates[tenant]
        weight_left -= weight(tenant)
    return {}


@dataclass(slots=True)
class _Bucket:
    rate: float  # the tenant's share, req/s
    tokens: float
    at: float  # when tokens was counted (monotonic)

    @property
    def size(self) -> float:
        return max(1.0, self.rate * BURST_S)

    def refill(self, now: float) -> None:
        self.tokens = min(self.size, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self, now: float) -> bool:
        self.refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class TenantShares:
    """``allow(tenant, now)`` for each request the door sees; ``tick`` from saturation.py."""

    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights = dict(weights or {})
        self.active = False
        self.rate = 0.0  # req/s the router admits while active
        self._floor = 0.0
        self._calm = 0  # ticks in a row not short of CPU
        self._counts: dict[str, int] = {}  # requests seen this tick, per tenant (while active)
        self._rates: dict[str, float] = {}  # smoothed req/s, per tenant
        self._buckets: dict[str, _Bucket] = {}  # tenants over their share

    def allow(self, tenant: str, now: float) -> bool:
        """Whether a request of ``tenant`` may come in; counts it.  Always while not active."""
        if not self.active:
            return True
        self._counts[tenant] = self._counts.get(tenant, 0) + 1
        bucket = self._buckets.get(tenant)
        return bucket is None or bucket.take(now)

    def share_of(self, tenant: str) -> float | None:
        """The tenant's share (req/s) while it is limited, else None."""
        bucket = self._buckets.get(tenant)
        return bucket.rate if bucket is not None else None

    def rates(self) -> dict[str, float]:
        """The tenants measured (while active) and the rate each sends, req/s."""
        return dict(self._rates)

    def offered(self) -> float:
        return sum(self._rates.values())

    def tick(self, short: bool, throughput: float | None, elapsed_s: float, now: float, *, draining: bool = False) -> None:
        """Once a tick: ``short`` whether the router is short of CPU, ``draining`` whether the
        kernel's queue shrinks all the same, ``throughput`` the rate requests finished at lately
        (req/s; None: not known)."""
        if not self.active:
            if short and throughput:
                self.active, self.rate, self._calm = True, max(1.0, throughput * START), 0
                self._floor = self.rate * FLOOR
                log.warning("short of CPU (requests wait in the kernel to be read): admitting %.0f requests a second "
                            "in fair shares per tenant, the excess refused 429 at the door", self.rate)
            return
        self._measure(elapsed_s)
        served = max(self._floor, throughput or 0.0)
        if short:
            self._calm = 0
            if not draining:  # below what is served now, so that it binds at once
                self.rate = max(self._floor, min(self.rate, served) * DECREASE)
        else:
            self._calm += 1
            if self.rate < served * HEADROOM:  # (a rate above it stays: a lull is not a lack of CPU)
                self.rate = min(self.rate * INCREASE, served * HEADROOM)
            if self._calm >= CALM_TICKS and self.rate >= self.offered():
                log.warning("no longer short of CPU: fair shares end (%.0f requests a second offered)", self.offered())
                self._end()
                return
        shares = fair_shares(self._rates, self.rate, self.weights)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("fair shares: short %s, rate %.0f, offered %.0f by %d tenants, %d limited: %s", short, self.rate,
                      self.offered(), len(self._rates), len(shares),
                      {t: round(r) for t, r in sorted(shares.items(), key=lambda kv: -kv[1])[:4]})
        old = self._buckets
        self._buckets = {}
        for tenant, share in shares.items():
            bucket = old.get(tenant)
            if bucket is None:
                bucket = _Bucket(share, max(1.0, share * BURST_S), now)
            else:
                bucket.refill(now)  # tokens earned at the old rate, then at the new one
                bucket.rate = share
            self._buckets[tenant] = bucket

    def _measure(self, elapsed_s: float) -> None:
        counts, self._counts = self._counts, {}
        rates = self._rates
        for tenant in set(rates) | set(counts):
            now_rate = counts.get(tenant, 0) / elapsed_s
            old = rates.get(tenant)
            rate = now_rate if old is None else RATE_SMOOTHING * now_rate + (1 - RATE_SMOOTHING) * old
            if rate < FORGET_RATE and tenant not in counts:
                rates.pop(tenant, None)
            else:
                rates[tenant] = rate
        while len(rates) > MAX_TENANTS:
            rates.pop(min(rates, key=rates.__getitem__))

    def _end(self) -> None:
        self.active = False
        self.rate = 0.0
        self._counts.clear()
        self._rates.clear()
        self._buckets.clear()

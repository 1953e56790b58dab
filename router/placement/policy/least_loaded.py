"""Least-loaded: fewest requests in flight (docs/design.md §5.3).

As KubeAI's ``LeastLoad`` strategy (``internal/loadbalancer/balance_least_load.go``): the endpoint
with the lowest router-tracked in-flight count wins.  KubeAI scans a Go map, whose iteration order
is randomised, so ties fall on an arbitrary endpoint; here ties are broken by a seeded
``random.Random`` so runs are reproducible and no replica is favoured by its position.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query


class LeastLoadedPolicy(Policy):
    name = "least_loaded"
    reasons = ("load",)

    def __init__(self, *, seed: int = 0):
        self._rng = random.Random(seed)

    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice:
        low = min(r.in_flight for r in replicas)
        tied = [r for r in replicas if r.in_flight == low]
        pick = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        return Choice(pick.name, "load", req.matches.get(pick.name, 0))

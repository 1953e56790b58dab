"""Power of two choices: two distinct random replicas, the less loaded one wins (docs/design.md §5.4).

As sglang-router 0.3.2 (``policies/power_of_two.rs``): ``i1`` uniform over the healthy workers,
``i2 = (i1 + 1 + uniform(0..n-1)) % n`` so the two always differ; ``i1`` wins ties
(``load1 <= load2``).  The load compared is the router's own in-flight count, which is what sglang
falls back to when its optional token-load monitor has no figures for both workers.  The random
source is a seeded ``random.Random`` (sglang uses a thread-local RNG) so runs are reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"
    reasons = ("load",)

    def __init__(self, *, seed: int = 0):
        self._rng = random.Random(seed)

    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice:
        n = len(replicas)
        if n == 1:
            return Choice(replicas[0].name, "load", req.matches.get(replicas[0].name, 0))
        i1 = self._rng.randrange(n)
        i2 = (i1 + 1 + self._rng.randrange(n - 1)) % n
        a, b = replicas[i1], replicas[i2]
        pick = a if a.in_flight <= b.in_flight else b
        return Choice(pick.name, "load", req.matches.get(pick.name, 0))

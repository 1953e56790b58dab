"""Round-robin: the control baseline (docs/design.md §5.2).

As sglang-router 0.3.2 (``policies/round_robin.rs``): one counter shared by all requests, the
pick is ``counter % len(healthy workers)``, the counter advances on every request.  Cycling is
over the eligible replicas in the order the caller passes them, so a replica that leaves or comes
back shifts the cycle, as it does in sglang.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query


class RoundRobinPolicy(Policy):
    name = "round_robin"
    reasons = ("round_robin",)

    def __init__(self, *, seed: int = 0):
        self._counter = 0  # ``seed`` is accepted for a uniform constructor; nothing is random here

    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice:
        pick = replicas[self._counter % len(replicas)]
        self._counter += 1
        return Choice(pick.name, "round_robin", req.matches.get(pick.name, 0))

"""Routing policies: kvroute's cost model and the baselines it is measured against.

``make_policy(name, **options)`` builds one by name; every policy accepts ``seed``.  ``ALL`` is
what a comparison runs (the default first); ``POLICIES`` also holds ``greedy_ttft``, the cost
model before it priced the fleet.
"""

from __future__ import annotations

from kvroute.router.placement.policy.base import Choice, Policy, ReplicaState, Query
from kvroute.router.placement.policy.chwbl import ChwblPolicy
from kvroute.router.placement.policy.cost_model import CostModelPolicy
from kvroute.router.placement.policy.greedy_ttft import GreedyTtftPolicy
from kvroute.router.placement.policy.least_loaded import LeastLoadedPolicy
from kvroute.router.placement.policy.power_of_two import PowerOfTwoPolicy
from kvroute.router.placement.policy.round_robin import RoundRobinPolicy
from kvroute.router.placement.policy.sglang_cache_aware import SglangCacheAwarePolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        CostModelPolicy,
        RoundRobinPolicy,
        LeastLoadedPolicy,
        PowerOfTwoPolicy,
        ChwblPolicy,
        SglangCacheAwarePolicy,
        GreedyTtftPolicy,
    )
}
BASELINES: list[str] = ["round_robin", "least_loaded", "power_of_two", "chwbl", "sglang_cache_aware"]
ALL: list[str] = ["cost_model", *BASELINES]


def make_policy(name: str, **options: object) -> Policy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    try:
        return cls(**options)
    except TypeError as exc:  # an option this policy does not take
        raise ValueError(f"policy {name!r}: {exc}") from exc


__all__ = [
    "ALL",
    "BASELINES",
    "POLICIES",
    "Choice",
    "Policy",
    "ReplicaState",
    "Query",
    "make_policy",
]

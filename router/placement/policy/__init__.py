"""Routing policies: kvroute's cost model and the baselines it is measured against.

``make_policy(name, **options)`` builds one by name; every policy accepts ``seed``.  ``ALL`` is
what a comparison runs (the default first); ``POLICIES`` also holds ``greedy_ttft``, the cost
model before it priced the fleet.
"""

from __future__ import annotations

from .base import Decision, Policy, ReplicaState, RouteRequest
from .chwbl import ChwblPolicy
from .cost_model import CostModelPolicy
from .greedy_ttft import GreedyTtftPolicy
from .least_loaded import LeastLoadedPolicy
from .power_of_two import PowerOfTwoPolicy
from .round_robin import RoundRobinPolicy
from .sglang_cache_aware import SglangCacheAwarePolicy

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
    "Decision",
    "Policy",
    "ReplicaState",
    "RouteRequest",
    "make_policy",
]

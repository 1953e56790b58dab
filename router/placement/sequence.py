"""The routing sequence, one code path for the router and the fleet simulator alike (docs/design.md §1).

lookup (which replica holds how much of the chain) -> choose (the policy, over a snapshot of the
eligible replicas) -> record (the chosen replica is predicted to hold the chain) -> load (its
uncached prompt tokens queue there until the first token).  ``bench/sim.py`` calls the same
functions as ``router/routing.py``, so what the simulator measures is what the router does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from kvroute.router.placement.load import LoadTracker
from kvroute.router.placement.policy.base import Decision, Policy, ReplicaState, RouteRequest


Replicas = Sequence[ReplicaState]  # the eligible ones, as snapshots
Chains = Sequence[Sequence[int]] | None  # every chain of a batch of prompts; None: the route's own


class Predictions(Protocol):
    """The two index calls routing makes: a lookup it waits for, a prediction it does not
    (``kvroute.router.index.IndexClient``, over Redis or, in the simulator too, the memory index)."""

    def lookup(self, chain: Sequence[int]) -> Awaitable[dict[str, int]]: ...

    def record_prediction(self, replica: str, chain: Sequence[int]) -> None: ...


def snapshot(name: str, load: LoadTracker, running: int) -> ReplicaState:
    """A replica as the policy sees it for one decision: this router's load and the engine's count."""
    own = load.state(name)
    return ReplicaState(
        name=name,
        in_flight=own.in_flight,
        queued_prefill_tokens=own.queued_prefill_tokens,
        running=running,
        prefill_rate=own.prefill_rate,
        rate_sampled_at=own.rate_sampled_at,
    )


class Placement:
    """Where requests go: one policy, the index's predictions and the router's load, in sequence."""

    def __init__(
        self, policy: Policy, index: Predictions, load: LoadTracker, claim: Callable[[str], bool] | None = None
    ):
        self.policy = policy
        self.index = index
        self.load = load
        # the router's Fleet.claim: a half-open replica's one trial is the request placed there
        self.claim = claim

    async def place(self, route: RouteRequest, replicas: Replicas, load_key: str, chains: Chains = None) -> Decision:
        """The whole sequence: fills ``route.matches`` from the index, then :meth:`commit`.

        ``chains``: every chain to record (a batch of prompts); the route's own chain by default.
        """
        route.matches = await self.index.lookup(route.chain) if route.chain else {}
        return self.commit(route, replicas, load_key, chains)

    def commit(self, route: RouteRequest, replicas: Replicas, load_key: str, chains: Chains = None) -> Decision:
        """choose -> record -> load, for a route whose matches are known (a failover reuses them)."""
        decision = self.policy.choose(route, replicas)
        if self.claim is not None and not self.claim(decision.replica) and len(replicas) > 1:
            # a half-open replica whose trial another request took since `replicas` was read
            return self.commit(route, [r for r in replicas if r.name != decision.replica], load_key, chains)
        self.policy.on_routed(route, decision)
        for chain in (route.chain,) if chains is None else chains:
            if chain:
                self.index.record_prediction(decision.replica, chain)
        # the queued prefill work is what the policy believed uncached
        uncached = max(0, route.prompt_tokens - decision.matched_blocks * route.block_size)
        self.load.on_routed(load_key, decision.replica, uncached)
        return decision

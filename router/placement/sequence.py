"""The routing sequence, one code path for the router and the fleet simulator alike (docs/design.md §1).

lookup (which replica holds how much of the chain) -> choose (the policy, over a snapshot of the
eligible replicas) -> commit (the chosen replica is predicted to hold the chain; its uncached
prompt tokens queue there until the first token); then, once the replica answers,
``first_token`` (the load learns the replica's prefill rate, the policy its timing) and
``finished`` (the load is released).  ``bench/sim.py`` calls the same steps as
``router/request/``, so what the simulator measures is what the router does.

Every step takes values and returns values: the router claims a half-open replica's trial
between ``choose`` and ``commit`` itself (``Router.route``), nothing here reaches the fleet.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Protocol

from kvroute.router.placement.load import LoadTracker
from kvroute.router.placement.policy.base import Choice, Policy, Query, ReplicaState

Replicas = Sequence[ReplicaState]  # the eligible ones, as snapshots
Chains = Sequence[Sequence[int]] | None  # every chain of a batch of prompts; None: the query's own


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

    def __init__(self, policy: Policy, index: Predictions, load: LoadTracker):
        self.policy = policy
        self.index = index
        self.load = load
        # told the replica whose queued work just dropped (late binding's holds, placement/hold.py)
        self.on_freed: Callable[[str], None] | None = None

    def snapshot(self, name: str, running: int) -> ReplicaState:
        """``name`` as the policy sees it for one decision (``running``: the engine's own count)."""
        return snapshot(name, self.load, running)

    async def lookup(self, query: Query) -> Query:
        """``query`` with the index's matches (none for an empty chain)."""
        if not query.chain:
            return query
        return replace(query, matches=MappingProxyType(await self.index.lookup(query.chain)))

    def choose(self, query: Query, replicas: Replicas) -> Choice:
        """The policy's pick among ``replicas`` (non-empty) for a query whose matches are known."""
        return self.policy.choose(query, replicas)

    def commit(self, query: Query, choice: Choice, load_key: str, chains: Chains = None) -> None:
        """record -> load: the request goes to ``choice.replica``.

        ``chains``: every chain to record (a batch of prompts); the query's own by default.
        """
        self.policy.on_routed(query, choice)
        for chain in (query.chain,) if chains is None else chains:
            if chain:
                self.index.record_prediction(choice.replica, chain)
        # the queued prefill work is what the policy believed uncached
        uncached = max(0, query.prompt_tokens - choice.matched_blocks * query.block_size)
        self.load.on_routed(load_key, choice.replica, uncached)

    async def place(self, query: Query, replicas: Replicas, load_key: str, chains: Chains = None) -> tuple[Query, Choice]:
        """The whole sequence, lookup -> choose -> commit: the query as looked up, and the choice."""
        query = await self.lookup(query)
        choice = self.choose(query, replicas)
        self.commit(query, choice, load_key, chains)
        return query, choice

    # -- after the answer ---------------------------------------------------------------------
    def first_token(self, load_key: str, ttft_s: float, now: float) -> None:
        """The request's first token came back after ``ttft_s`` (``now``: the query's clock): its
        prefill left the replica's queue; the load learns the rate, the policy the timing."""
        seen = self.load.on_first_token(load_key, ttft_s, now)
        if seen is not None:
            replica, uncached = seen
            self.policy.on_first_token(replica, uncached, ttft_s)
            if self.on_freed is not None:
                self.on_freed(replica)

    def finished(self, load_key: str) -> None:
        """The request ended (answered, failed, abandoned, or failed over): release its load."""
        replica = self.load.on_finished(load_key)
        if replica is not None and self.on_freed is not None:
            self.on_freed(replica)

"""The routing-policy interface shared by the router service and the fleet simulator (docs/design.md §5.1).

A policy sees one request (its block chain, the index's matches, a session key, the prompt text
for character-matching baselines) and the current state of every eligible replica, and picks one.
It is synchronous and does no I/O: the caller has already done the index lookup.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

_NO_MATCHES: Mapping[str, int] = MappingProxyType({})


@dataclass(slots=True)
class ReplicaState:
    """One eligible replica as a policy sees it: a snapshot taken for one decision, built from the
    router's own load accounting (``kvroute.router.placement.load``) and the fleet's last scrape (or, in the
    simulator, the emulated engines).  Policies read it; nothing writes it back."""

    name: str
    in_flight: int = 0  # requests routed there and not finished (router-tracked)
    queued_prefill_tokens: int = 0  # uncached prompt tokens routed there, first token not yet back
    running: int = 0  # vllm:num_requests_running (scraped: other routers' requests show here)
    prefill_rate: float = 0.0  # tokens/s, learned online; 0 = unknown yet
    rate_sampled_at: float = -math.inf  # when the rate last took a sample (``Query.now``'s clock)


@dataclass(frozen=True, slots=True)
class Query:
    """One request as a policy sees it: the question it answers (which replica for this chain?).
    Frozen: the index's matches are filled in by a new Query (``Placement.lookup``)."""

    chain: Sequence[int]  # block hashes of the prompt (full blocks only)
    prompt_tokens: int
    block_size: int
    matches: Mapping[str, int] = field(default_factory=lambda: _NO_MATCHES)  # replica -> leading blocks held
    session_key: str | None = None
    text: str = ""  # the prompt as text, for baselines that match characters
    now: float = 0.0  # seconds, on the caller's clock (virtual time in the simulator)


@dataclass(frozen=True, slots=True)
class Choice:
    """What a policy chose for one query."""

    replica: str
    reason: str  # why: "cache", "session", "load", "balance", "hash", "round_robin", ...
    matched_blocks: int = 0  # blocks the policy believed the chosen replica held


class Policy(abc.ABC):
    """Pick a replica for a request.  ``replicas`` holds only healthy, eligible ones (non-empty)."""

    name: str = ""
    # every `Choice.reason` the policy can give: metrics create these series at zero
    reasons: tuple[str, ...] = ()
    # policies that match prompt text rather than tokens (SGLang's rule) ask for it: only they
    # pay for flattening the prompt into `Query.text`
    needs_text: bool = False

    @abc.abstractmethod
    def choose(self, req: Query, replicas: Sequence[ReplicaState]) -> Choice: ...

    def on_routed(self, req: Query, decision: Choice) -> None:  # noqa: B027
        """The request was sent to ``decision.replica`` (policies with their own state record it)."""

    def on_first_token(self, replica: str, uncached_tokens: int, ttft_s: float) -> None:  # noqa: B027
        """A request's first token arrived: policies that learn from timing use it."""

    def forget_replica(self, replica: str) -> None:  # noqa: B027
        """The replica left the fleet."""

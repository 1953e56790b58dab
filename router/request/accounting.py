"""What a request's answer teaches the router, once it is known: the steps after the route
(docs/design.md §1, step 9).

``first_token`` (the replica's first token came back: the placement learns its prefill rate and
the policy its timing, the TTFT histogram a sample), ``report`` (the request ended, answered or
not: its load is released, it is counted, and the cached tokens the engine reported are read)
and ``account`` (the hit-rate breakdown of an answered request, docs/design.md §6: CPU work the
client need not wait for, so the edge runs it once the answer is written).  Each takes values
and returns values; the simulator calls the same placement steps (``first_token``, ``finished``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvroute.router.forwarding.proxy import Outcome
from kvroute.router.forwarding.sse import Usage
from kvroute.router.metrics import RouterMetrics
from kvroute.router.placement.sequence import Placement
from kvroute.router.request.reuse import ReuseTracker
from kvroute.router.request.route import Route


def engine_cached_tokens(usage: Usage | None, reports_details: bool) -> int | None:
    """Cached prompt tokens the engine reported, or None if it does not report them.

    vLLM leaves ``prompt_tokens_details`` null when nothing was cached, and also when
    ``--enable-prompt-tokens-details`` is off; a replica that has reported details once has
    the flag on (``reports_details``), so from then on its null means zero.
    """
    if usage is None:
        return None
    if usage.cached_tokens is not None:
        return usage.cached_tokens
    return 0 if reports_details else None


def output_tokens(usage: Usage | None, stream_events: int) -> int:
    """The answer's output tokens: the usage the replica reports, else a stream's data events
    (one token each, as vLLM streams; 0 for a whole answer without usage, which cannot be counted)."""
    if usage is not None and usage.completion_tokens is not None:
        return usage.completion_tokens
    return stream_events


class Accounting:
    """The router's steps after the answer: load released, rates learned, figures counted."""

    def __init__(self, placement: Placement, reuse: ReuseTracker, metrics: RouterMetrics):
        self.placement = placement
        self.reuse = reuse
        self.metrics = metrics
        self._reports_details: set[str] = set()  # replicas known to fill usage.prompt_tokens_details

    def first_token(self, route: Route, ttft_s: float) -> None:
        self.placement.first_token(route.load_key, ttft_s, time.monotonic())
        self.metrics.model(route.model).ttft.observe(ttft_s)

    def report(self, route: Route, outcome: Outcome) -> int | None:
        """The request ended (answered, failed or abandoned): release its load and count it.  The
        cached prompt tokens its engine reported (None: it reports none), for :meth:`account` and
        the access log."""
        self.placement.finished(route.load_key)
        self.metrics.answered(route.model, outcome.replica or route.replica, outcome.status)
        if 200 <= outcome.status < 300:
            self._client_saw(route.model, outcome)
        usage, replica = outcome.usage, outcome.replica
        if usage is None or replica is None:
            return None
        if usage.cached_tokens is not None:
            self._reports_details.add(replica)
        return engine_cached_tokens(usage, replica in self._reports_details)

    def _client_saw(self, model: str, outcome: Outcome) -> None:
        """An answered request's SRE figures: end to end, output tokens, a stream's inter-token latency."""
        sre = self.metrics.model(model).sre
        if outcome.duration_s is not None:
            sre.duration.observe(outcome.duration_s)
        tokens = output_tokens(outcome.usage, outcome.events)
        if tokens:
            sre.output_tokens.inc(tokens)
        if outcome.decode_s is not None and tokens > 1:
            sre.inter_token_latency.observe(outcome.decode_s / (tokens - 1))

    def account(self, route: Route, cached_tokens: int | None) -> None:
        """The hit-rate breakdown, for answered requests only: the figures share one denominator."""
        m = self.metrics.model(route.model)
        block_size = route.query.block_size
        tokens = route.prompt.tokens
        m.prompt_tokens.inc(tokens)
        m.reuse_available.inc(self._observe_reuse(route, route.chains, route.prompt.data) * block_size)
        m.reuse_predicted.inc(route.predicted_blocks * block_size)
        if cached_tokens is not None:
            m.reuse_delivered.inc(cached_tokens)
            m.reuse_measured_prompt.inc(tokens)

    def forget_replica(self, name: str) -> None:
        """A replica left the fleet: it may come back under its name as another process."""
        self._reports_details.discard(name)

    def _observe_reuse(self, route: Route, chains: Sequence[Sequence[int]], datas: Sequence[bytes]) -> int:
        """Available blocks over the batch; flags a cache-hostile prompt."""
        available = 0
        hostile = False
        block_size = route.query.block_size
        for chain, data in zip(chains, datas):
            ids = np.frombuffer(data, dtype="<u4")
            seen = self.reuse.observe(route.model, chain, ids, block_size, route.seed)
            available += seen.available_blocks
            hostile = hostile or seen.cache_hostile
        if hostile:
            self.metrics.hostile(route.client)
        return available

"""Router-side load accounting per replica, shared by the router service and the simulator.

Tracks what the router itself sent: requests in flight, and uncached prompt tokens whose first
token has not come back (the prefill work queued ahead of a new request).  It also learns each
replica's prefill rate online: a request's first token arrives after the prefill work that was
queued ahead of it plus its own, so (work ahead + own uncached tokens) / TTFT samples the rate.
The rate is sampled work over sampled time, each an EWMA over samples (a long prefill weighs
what it took, where a mean of per-request rates lets short, overhead-bound ones dominate).  The
prior holds until the first sample, which replaces it, as does a sample more than
``RATE_STALE_S`` after the last one: a replica that got no traffic for a while may have
recovered, or degraded, since.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_PREFILL_RATE = 10_000.0  # tokens/s, a prior until the first samples arrive
RATE_EWMA_ALPHA = 0.2  # weight of a new sample in the decayed sums
MIN_SAMPLE_TOKENS = 64  # tiny prefills are dominated by fixed costs: poor rate samples
RATE_STALE_S = 30.0  # a learned rate older than this is replaced by the next sample, not averaged


@dataclass
class ReplicaLoad:
    """What this router sent one replica: its own count, not the engine's (the fleet scrapes that)."""

    in_flight: int = 0  # requests routed there and not finished
    queued_prefill_tokens: int = 0  # uncached prompt tokens routed there, first token not yet back
    prefill_rate: float = DEFAULT_PREFILL_RATE  # tokens/s, learned online
    rate_sampled_at: float = -math.inf  # when the rate last took a sample (the caller's clock)
    # the rate is work over time, both decayed per sample: long prefills weigh what they took
    sampled_work: float = 0.0
    sampled_time: float = 0.0


@dataclass
class _Pending:
    replica: str
    uncached: int
    work_ahead: int  # queued prefill tokens ahead of it, plus its own uncached tokens
    first_token_seen: bool = False


class LoadTracker:
    def __init__(self, prior_rate: float = DEFAULT_PREFILL_RATE):
        self.prior_rate = prior_rate
        self.states: dict[str, ReplicaLoad] = {}
        self._pending: dict[str, _Pending] = {}

    def state(self, replica: str) -> ReplicaLoad:
        st = self.states.get(replica)
        if st is None:
            st = self.states[replica] = ReplicaLoad(prefill_rate=self.prior_rate)
        return st

    def remove(self, replica: str) -> None:
        self.states.pop(replica, None)
        for rid in [rid for rid, p in self._pending.items() if p.replica == replica]:
            del self._pending[rid]

    def on_routed(self, request_id: str, replica: str, uncached_tokens: int) -> None:
        st = self.state(replica)
        work_ahead = st.queued_prefill_tokens + uncached_tokens
        st.in_flight += 1
        st.queued_prefill_tokens += uncached_tokens
        self._pending[request_id] = _Pending(replica, uncached_tokens, work_ahead)

    def on_first_token(self, request_id: str, ttft_s: float, now: float) -> tuple[str, int] | None:
        """Returns (replica, uncached tokens) of the request, or None if unknown.  ``now``: the
        caller's clock (``Query.now``'s), when the first token came."""
        p = self._pending.get(request_id)
        if p is None or p.first_token_seen:
            return None
        p.first_token_seen = True
        st = self.state(p.replica)
        st.queued_prefill_tokens = max(0, st.queued_prefill_tokens - p.uncached)
        if ttft_s > 0 and p.work_ahead >= MIN_SAMPLE_TOKENS:
            fresh = now - st.rate_sampled_at > RATE_STALE_S  # the first sample, or one after a silence
            alpha = 1.0 if fresh else RATE_EWMA_ALPHA
            st.sampled_work = (1 - alpha) * st.sampled_work + alpha * p.work_ahead
            st.sampled_time = (1 - alpha) * st.sampled_time + alpha * ttft_s
            st.prefill_rate = st.sampled_work / st.sampled_time
            st.rate_sampled_at = now
        return p.replica, p.uncached

    def on_finished(self, request_id: str) -> str | None:
        """The request ended (success, failure or abort): release everything it held.  Returns
        its replica, or None if unknown."""
        p = self._pending.pop(request_id, None)
        if p is None:
            return None
        st = self.state(p.replica)
        st.in_flight = max(0, st.in_flight - 1)
        if not p.first_token_seen:
            st.queued_prefill_tokens = max(0, st.queued_prefill_tokens - p.uncached)
        return p.replica

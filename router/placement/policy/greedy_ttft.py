"""The cost model as it was before it priced the fleet (kept to compare against, and for fleets
where every request's own TTFT is all that matters): argmin of this request's estimated TTFT under
the same bounds, sessions and starvation rule, with no queued-behind or eviction terms."""

from __future__ import annotations

from kvroute.router.placement.policy.cost_model import CostModelPolicy


class GreedyTtftPolicy(CostModelPolicy):
    name = "greedy_ttft"

    def __init__(self, **options: object):
        options.setdefault("queued_behind", 0.0)
        options.setdefault("epsilon", 1.0)
        options.setdefault("session_epsilon", 0.0)
        options.setdefault("keep_tokens", None)  # the bound applies to every request, as it did
        super().__init__(**options)  # type: ignore[arg-type]

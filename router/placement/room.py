"""When a replica has room for one more request: the rule late binding holds requests by
(docs/design.md §5.9).

A replica has room while the uncached prompt tokens this router sent it, whose first token has
not come back, fit one scheduler step's token budget (``max_queued_tokens``, vLLM's
``max_num_batched_tokens``, 8192 by default): past that, what is sent next waits in vLLM's queue
for a later step, committed to that replica whatever happens elsewhere meanwhile.  The router's
own count is current at every decision; vLLM's ``num_requests_waiting`` reaches the router by a
scrape up to a second old, and holding on it measured worse in the simulator (docs/experiments.md,
2026-12-04 late binding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_MAX_QUEUED_TOKENS = 8192  # vLLM's max_num_batched_tokens on a GPU server (one step's budget)


class QueuedWork(Protocol):
    queued_prefill_tokens: int  # uncached prompt tokens routed there, first token not yet back


@dataclass(frozen=True, slots=True)
class RoomRule:
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS

    def has_room(self, load: QueuedWork) -> bool:
        """``load``: the replica as this router counts it (``ReplicaLoad`` or a ``ReplicaState`` snapshot)."""
        return load.queued_prefill_tokens <= self.max_queued_tokens

"""Late binding: a request whose chosen replica has no room waits at the router, not in that
replica's queue, and is placed again when the replica has room or its budget is spent
(docs/design.md §5.9).

Per replica, requests wait in arrival order: a new request for a replica others wait for queues
behind them.  When the replica's queued work drops (a first token or an end, ``notify``), the
first one still waiting is woken; it asks the policy again with the load and the caches of that
moment (it may go elsewhere), and, once committed, leaves the line and wakes the next while the
replica still has room.  A request waits at most ``max_wait_s``, then is placed all the same:
never refused, never lost for this.  A request cancelled while it waits (its client left) leaves
the line.  Off (``--hold-max-s 0``) by default: measured, it moves the gate's workloads within
their run-to-run spread, except a slow replica's tail (docs/experiments.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvroute.router.placement.load import LoadTracker
from kvroute.router.placement.room import RoomRule


@dataclass(eq=False)
class _Waiter:
    room: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Holds:
    """The lines of requests held for a replica.  ``on_wait(seconds, roomy)``: each held request's
    wait once it ends (``roomy``: the replica had room before the budget was spent)."""

    def __init__(self, load: LoadTracker, rule: RoomRule, max_wait_s: float,
                 on_wait: Callable[[float, bool], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.load = load
        self.rule = rule
        self.max_wait_s = max_wait_s
        self.on_wait = on_wait
        self.clock = clock
        self._lines: dict[str, deque[_Waiter]] = {}  # replica -> waiters, arrival order

    @property
    def waiting(self) -> int:
        """Requests held right now (those being placed after their wait included)."""
        return sum(len(line) for line in self._lines.values())

    def must_wait(self, replica: str) -> bool:
        """A request the policy sent to ``replica`` waits: the replica has no room, or others wait for it."""
        return replica in self._lines or not self.rule.has_room(self.load.state(replica))

    @contextlib.asynccontextmanager
    async def turn(self, replica: str) -> AsyncIterator[bool]:
        """Wait in ``replica``'s line until it has room (yields True) or the budget is spent
        (False); place the request inside the block: the line moves on when it exits."""
        me = _Waiter()
        line = self._lines.setdefault(replica, deque())
        line.append(me)
        start = self.clock()
        roomy = False
        try:
            self._wake(replica)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(me.room), self.max_wait_s)
                roomy = True
            if self.on_wait is not None:
                self.on_wait(self.clock() - start, roomy)
            yield roomy
        finally:
            line.remove(me)
            if not line:
                del self._lines[replica]
            self._wake(replica)

    def notify(self, replica: str) -> None:
        """``replica``'s queued work dropped: the first in its line goes if it now has room."""
        if replica in self._lines:
            self._wake(replica)

    def _wake(self, replica: str) -> None:
        line = self._lines.get(replica)
        if not line or not self.rule.has_room(self.load.state(replica)):
            return
        head = line[0]
        if not head.room.done():
            head.room.set_result(None)

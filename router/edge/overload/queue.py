"""The admission queue: a request that finds no room waits here, in fair order, at most
``max_queue_wait_s``, and is answered a 429 ``router_overloaded`` with Retry-After when its wait
would pass that budget.

Room is a list of conditions on a request's tenant, all of which must hold (admission.py gives the
in-flight limit that saturation.py moves, with the last slots kept for tenants under their share:
reserve.py; a condition such as "a replica has room" can be added with
:meth:`AdmissionQueue.add_condition`, its owner calling :meth:`poke` when it may have become true).
:meth:`poke` hands free room to the first waiter, in order, whose tenant it may go to: the slot is
taken for the waiter before it wakes, so no newcomer can take it in between.

The queue holds at most ``max_queue_length`` requests and at most ``max_queue_wait_s`` x the rate it
drains at (the rate requests finished at while some waited): a request queued further back would
certainly wait past its budget, so it is refused at once, and when a newcomer sorts in front of
others it pushes the last one out (the lowest class, the heaviest tenant: fair_queue.py).  A waiter
whose budget runs out is taken out and refused.  Only waiting requests are refused: an admitted
one, a stream above all, is never cut for admission (design.md §7.6).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping

from kvroute.common.errors import ApiError

from kvroute.router.edge.overload.fair_queue import FairQueue, Queued
from kvroute.router.edge.overload.tenants import Priority
from kvroute.router.metrics import OverloadMetrics

ADMITTED, TIMED_OUT, DISPLACED = "admitted", "timeout", "displaced"
SCAN = 64  # queued requests looked at for one whose tenant may take the room


def overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, code="router_overloaded", headers={"Retry-After": str(retry_after_s)})


class AdmissionQueue:
    def __init__(
        self,
        *,
        max_wait_s: float,
        max_length: int,
        weights: Mapping[str, float],
        retry_after_s: int,
        drain_rate: Callable[[], float | None],
        take: Callable[[str], None],
        give_back: Callable[[str], None],
        metrics: OverloadMetrics,
    ):
        self.max_wait_s = max_wait_s
        self.max_length = max_length
        self.retry_after_s = retry_after_s
        self.fair = FairQueue(weights)
        self._conditions: list[Callable[[str], bool]] = []
        self._drain_rate = drain_rate
        self._take = take  # claims the room (one more in flight) for a tenant's request about to run
        self._give_back = give_back  # ... and returns it (a waiter admitted as its client left)
        self.metrics = metrics

    def __len__(self) -> int:
        return len(self.fair)

    def add_condition(self, condition: Callable[[str], bool]) -> None:
        """``condition(tenant)``: whether a request of that tenant may run now."""
        self._conditions.append(condition)

    def has_room(self, tenant: str) -> bool:
        return all(condition(tenant) for condition in self._conditions)

    def capacity(self) -> int:
        """Requests that may wait: those the queue drains within the budget, at most ``max_length``."""
        rate = self._drain_rate()
        if rate is None:  # not measured yet: the budget's own timeout sheds
            return self.max_length
        return min(self.max_length, math.floor(self.max_wait_s * rate))

    def poke(self) -> None:
        """Room may have appeared: admit waiters, in order, while there is some (for the first of the
        next ``SCAN`` whose tenant may take it: reserve.py keeps the last slots for some tenants)."""
        fair = self.fair
        while len(fair):
            entry = fair.first(self._may_go, SCAN)
            if entry is None:
                break
            fair.take(entry)
            waiter: asyncio.Future[str] = entry.waiter
            if waiter.done():  # its client left this turn: the room goes to the next
                continue
            self._take(entry.tenant)
            waiter.set_result(ADMITTED)
        self.metrics.queue_depth.set(len(fair))

    def _may_go(self, entry: Queued) -> bool:
        return entry.waiter.done() or self.has_room(entry.tenant)

    async def wait(self, tenant: str, priority: Priority) -> None:
        """Wait for room (then it is taken: release it when done), or raise the 429."""
        loop = asyncio.get_running_loop()
        entry = Queued(tenant, int(priority), waiter=loop.create_future())
        arrived = time.perf_counter()
        position = self.fair.push(entry)
        capacity = self.capacity()
        while len(self.fair) > capacity:  # someone would certainly wait past the budget
            last = self.fair.last()
            assert last is not None
            self.fair.remove(last)
            self.metrics.shed(DISPLACED if last is not entry else "over_budget", Priority(last.priority))
            if last is entry:
                self.metrics.queue_depth.set(len(self.fair))
                raise overloaded(
                    f"the router is saturated: {position} requests queued ahead would take longer than its "
                    f"queue budget ({self.max_wait_s:g} s); retry shortly", self.retry_after_s)
            last.waiter.set_result(DISPLACED)
        self.poke()  # room for this tenant, where a waiting one had none (reserve.py)
        timer = loop.call_later(self.max_wait_s, self._expire, entry)
        try:
            outcome = await entry.waiter
        except asyncio.CancelledError:  # the client left while waiting
            timer.cancel()
            if self.fair.remove(entry):
                self.metrics.queue_depth.set(len(self.fair))
            elif entry.waiter.done() and not entry.waiter.cancelled() and entry.waiter.result() == ADMITTED:
                self._give_back(tenant)  # the room was taken for it this turn: the next waiter has it
            raise
        timer.cancel()
        if outcome == ADMITTED:
            self.metrics.queue_wait.observe(time.perf_counter() - arrived)
            return
        raise overloaded(
            f"the router is saturated: this request waited {time.perf_counter() - arrived:.2f} s of its queue budget "
            f"({self.max_wait_s:g} s)" + (" and was pushed out by more urgent or fairer ones" if outcome == DISPLACED
                                          else "") + "; retry shortly", self.retry_after_s)

    def _expire(self, entry: Queued) -> None:
        if self.fair.remove(entry) and not entry.waiter.done():
            self.metrics.shed(TIMED_OUT, Priority(entry.priority))
            self.metrics.queue_depth.set(len(self.fair))
            entry.waiter.set_result(TIMED_OUT)


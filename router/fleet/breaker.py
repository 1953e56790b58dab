"""Per-replica circuit breaker (docs/design.md §7.3).

closed --(N consecutive failures)--> open --(cooldown)--> half_open --(trial succeeds)--> closed
                                       ^                       |
                                       +----(trial fails)------+

While half-open, exactly one trial request is let through.  Asking is free: ``available()`` says
whether a request could go there now (a half-open replica is offered to the policy), and only the
request actually routed there takes the trial, with ``claim()``.  A trial whose request never
reports back (the client left before the first byte) lapses after another cooldown, so the replica
is never stuck.  ``reset()`` closes the circuit outright when health checks saw the replica down
and up again: its failures belonged to the outage that is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if failures < 1:
            raise ValueError("failures must be >= 1")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive_failures = 0
        self.opened_times = 0  # how often the circuit opened, for metrics
        self._state: BreakerState = "closed"
        self._opened_at = 0.0
        self._trial_at: float | None = None  # when the half-open trial was granted

    @property
    def state(self) -> BreakerState:
        """The current state; an open circuit reads half_open once its cooldown has passed."""
        if self._state == "open" and self.clock() - self._opened_at >= self.cooldown_s:
            self._state = "half_open"
            self._trial_at = None
        return self._state

    def available(self) -> bool:
        """Could a request go to this replica now?  No side effect: the trial stays unclaimed."""
        state = self.state
        if state == "half_open":
            return self._trial_free()
        return state == "closed"

    def claim(self) -> bool:
        """A request is being routed here: True if it may go (in half-open it takes the one trial)."""
        state = self.state
        if state == "half_open" and self._trial_free():
            self._trial_at = self.clock()
            return True
        return state == "closed"

    def reset(self) -> None:
        """Closed, failures forgotten (not counted as an opening)."""
        self.record_success()

    def _trial_free(self) -> bool:
        return self._trial_at is None or self.clock() - self._trial_at >= self.cooldown_s

    def record_success(self) -> None:
        self._state = "closed"
        self.consecutive_failures = 0
        self._trial_at = None

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        state = self.state
        if state == "half_open" or (state == "closed" and self.consecutive_failures >= self.failures):
            self._open()
        elif state == "open":
            # Failures still arriving from requests sent before the circuit opened: restart the
            # cooldown, the replica is evidently still failing.
            self._opened_at = self.clock()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = self.clock()
        self._trial_at = None
        self.opened_times += 1

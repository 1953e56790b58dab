"""Per-replica circuit breaker.

closed --(N consecutive failures)--> open --(cooldown)--> half_open --(trial succeeds)--> closed
                                       ^                       |
                                       +----(trial fails)------+

While half-open, exactly one trial request is let through.  The trial is granted by ``allow()``;
a caller that was granted it but never reports back (the policy picked another replica) must not
block the replica forever, so an unanswered trial lapses after another cooldown and a new one is
granted.
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

    def allow(self) -> bool:
        """May a request go to this replica now?  In half-open this grants the single trial."""
        state = self.state
        if state == "closed":
            return True
        if state == "open":
            return False
        now = self.clock()
        if self._trial_at is None or now - self._trial_at >= self.cooldown_s:
            self._trial_at = now
            return True
        return False

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

"""Circuit breaker state machine, on a virtual clock."""

from __future__ import annotations

import pytest

from router.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_opens_after_consecutive_failures_only(clock):
    b = CircuitBreaker(failures=3, cooldown_s=5.0, clock=clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # a success in between resets the count
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open"
    assert not b.allow()
    assert b.opened_times == 1


def test_half_open_after_cooldown_grants_one_trial(clock):
    b = CircuitBreaker(failures=1, cooldown_s=5.0, clock=clock)
    b.record_failure()
    clock.now += 4.9
    assert b.state == "open" and not b.allow()
    clock.now += 0.1
    assert b.state == "half_open"
    assert b.allow()  # the trial
    assert not b.allow()  # only one at a time


def test_trial_success_closes(clock):
    b = CircuitBreaker(failures=1, cooldown_s=1.0, clock=clock)
    b.record_failure()
    clock.now += 1.0
    assert b.allow()
    b.record_success()
    assert b.state == "closed"
    assert all(b.allow() for _ in range(3))


def test_trial_failure_reopens_for_a_full_cooldown(clock):
    b = CircuitBreaker(failures=2, cooldown_s=1.0, clock=clock)
    b.record_failure()
    b.record_failure()
    clock.now += 1.0
    assert b.allow()
    b.record_failure()  # one failure suffices in half-open
    assert b.state == "open" and b.opened_times == 2
    clock.now += 0.5
    assert not b.allow()
    clock.now += 0.5
    assert b.state == "half_open"


def test_unanswered_trial_lapses_so_the_replica_is_not_stuck(clock):
    # The policy may be offered a half-open replica and pick another: no report ever comes back.
    b = CircuitBreaker(failures=1, cooldown_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 2.0
    assert b.allow()
    clock.now += 1.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()


def test_late_failures_while_open_extend_the_cooldown(clock):
    b = CircuitBreaker(failures=1, cooldown_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 1.5
    b.record_failure()  # a request sent before the circuit opened fails late
    clock.now += 1.0
    assert b.state == "open"
    clock.now += 1.0
    assert b.state == "half_open"
    assert b.opened_times == 1


def test_rejects_nonsense_threshold():
    with pytest.raises(ValueError):
        CircuitBreaker(failures=0)

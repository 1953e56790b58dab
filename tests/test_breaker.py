"""Circuit breaker state machine, on a virtual clock."""

from __future__ import annotations

import pytest

from kvroute.router.fleet.breaker import CircuitBreaker


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
    assert b.state == "closed" and b.claim()
    b.record_failure()
    assert b.state == "open"
    assert not b.claim()
    assert b.opened_times == 1


def test_half_open_after_cooldown_grants_one_trial(clock):
    b = CircuitBreaker(failures=1, cooldown_s=5.0, clock=clock)
    b.record_failure()
    clock.now += 4.9
    assert b.state == "open" and not b.claim()
    clock.now += 0.1
    assert b.state == "half_open"
    assert b.available() and b.available()  # offered to the policy as often as asked
    assert b.claim()  # the trial, taken by the request routed there
    assert not b.available() and not b.claim()  # only one at a time


def test_trial_success_closes(clock):
    b = CircuitBreaker(failures=1, cooldown_s=1.0, clock=clock)
    b.record_failure()
    clock.now += 1.0
    assert b.claim()
    b.record_success()
    assert b.state == "closed"
    assert all(b.claim() for _ in range(3))


def test_trial_failure_reopens_for_a_full_cooldown(clock):
    b = CircuitBreaker(failures=2, cooldown_s=1.0, clock=clock)
    b.record_failure()
    b.record_failure()
    clock.now += 1.0
    assert b.claim()
    b.record_failure()  # one failure suffices in half-open
    assert b.state == "open" and b.opened_times == 2
    clock.now += 0.5
    assert not b.claim()
    clock.now += 0.5
    assert b.state == "half_open"


def test_asking_does_not_take_the_trial(clock):
    # The policy is offered the half-open replica and picks another: its trial stays for the
    # first request that is routed there, however many asked before.
    b = CircuitBreaker(failures=1, cooldown_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 2.0
    for _ in range(100):
        assert b.available()
    assert b.claim()


def test_closed_and_open_claims(clock):
    b = CircuitBreaker(failures=1, cooldown_s=2.0, clock=clock)
    assert b.available() and b.claim() and b.claim()  # closed: no trial to take
    b.record_failure()
    assert not b.available() and not b.claim()


def test_reset_closes_without_counting_an_opening(clock):
    b = CircuitBreaker(failures=1, cooldown_s=2.0, clock=clock)
    b.record_failure()
    b.reset()
    assert b.state == "closed" and b.available() and b.opened_times == 1
    b.record_failure()  # the failure count restarted
    assert b.state == "open"


def test_unanswered_trial_lapses_so_the_replica_is_not_stuck(clock):
    # The request that took the trial may never report back (its client left before the first byte).
    b = CircuitBreaker(failures=1, cooldown_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 2.0
    assert b.claim()
    clock.now += 1.0
    assert not b.claim()
    clock.now += 1.0
    assert b.claim()


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

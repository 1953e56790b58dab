"""Late binding in the simulator (bench/late_binding.py): held requests are all answered, none
past the budget, and holding changes where (and when) requests go."""

import numpy as np
import pytest

from kvroute.bench.late_binding import HoldingSim, Room, simulate_held
from kvroute.bench.sim import FleetConfig, prepare
from kvroute.bench.workloads import build_workload
from kvroute.replica.emulated.profile import DEFAULT_PROFILE
from kvroute.router.placement.policy import make_policy

BS = DEFAULT_PROFILE.block_size


@pytest.fixture(scope="module")
def busy():
    # no shared prefixes, a rate that queues 2 replicas: rooms fill and free all the time
    return prepare(build_workload("random", seed=3, requests=60, rate=40.0), BS)


@pytest.mark.parametrize("room", [
    Room(max_waiting=None, max_queued_tokens=0, hold_max_s=0.2),  # every replica full while any prefill is pending
    Room(max_waiting=None, max_queued_tokens=0, hold_max_s=0.2, release="choice"),
])
def test_held_requests_are_all_answered_within_their_budget(busy, room):
    cfg = FleetConfig(2, DEFAULT_PROFILE)
    sim = HoldingSim(busy, make_policy("cost_model", seed=1), cfg, room)
    run = sim.simulate()
    assert sim.stats.held > 0 and len(sim.stats.waits) == sim.stats.held
    assert max(sim.stats.waits) <= room.hold_max_s + 1e-6
    assert not sim.held
    assert np.isnan(run.first_token).sum() == 0 and (run.replica >= 0).all()  # every request sent, answered
    plain, _ = simulate_held(busy, make_policy("cost_model", seed=1), cfg, None)
    # the hold is what the engines saw: requests reached them later than they arrived
    assert (sim._sent_at - run.arrival).max() > 0
    assert np.array_equal(plain.arrival, run.arrival)

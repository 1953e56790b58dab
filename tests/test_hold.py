"""Late binding's parts on their own (docs/design.md §5.9): the room rule, and the lines of held
requests over a real ``LoadTracker`` (the router's, fed as the router feeds it)."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.placement.hold import Holds
from kvroute.router.placement.load import LoadTracker, ReplicaLoad
from kvroute.router.placement.room import RoomRule


def test_a_replica_has_room_while_its_queued_prefill_fits_one_step():
    rule = RoomRule(max_queued_tokens=8192)
    assert rule.has_room(ReplicaLoad(queued_prefill_tokens=0))
    assert rule.has_room(ReplicaLoad(queued_prefill_tokens=8192))
    assert not rule.has_room(ReplicaLoad(queued_prefill_tokens=8193))
    # what the rule reads is the router's count, which first tokens and ends lower
    load = LoadTracker()
    load.on_routed("a", "r0", 9000)
    assert not rule.has_room(load.state("r0"))
    load.on_first_token("a", 0.5, now=1.0)
    assert rule.has_room(load.state("r0"))


async def test_held_requests_go_in_arrival_order_when_the_replica_has_room():
    load = LoadTracker()
    holds = Holds(load, RoomRule(max_queued_tokens=100), max_wait_s=30.0)
    load.on_routed("busy", "r0", 500)  # r0 has no room
    assert holds.must_wait("r0") and not holds.must_wait("r1")
    placed: list[str] = []

    async def request(name: str) -> None:
        async with holds.turn("r0") as roomy:
            assert roomy
            placed.append(name)
            load.on_routed(name, "r0", 500)  # placed there: r0 is full again

    tasks = [asyncio.create_task(request(f"q{i}")) for i in range(3)]
    await asyncio.sleep(0.05)
    assert placed == [] and holds.waiting == 3
    assert holds.must_wait("r0")  # a newcomer queues behind them
    for i, done in enumerate(["busy", "q0", "q1"]):
        load.on_first_token(done, 0.1, now=float(i))
        holds.notify("r0")
        await asyncio.sleep(0.05)
        assert placed == [f"q{k}" for k in range(i + 1)]
    await asyncio.gather(*tasks)
    assert holds.waiting == 0


async def test_a_held_request_is_placed_when_its_budget_is_spent_and_a_cancelled_one_leaves():
    load = LoadTracker()
    waits: list[tuple[float, bool]] = []
    holds = Holds(load, RoomRule(max_queued_tokens=0), max_wait_s=0.3, on_wait=lambda s, roomy: waits.append((s, roomy)))
    load.on_routed("busy", "r0", 10)  # never answers

    async def request() -> bool:
        async with holds.turn("r0") as roomy:
            return roomy

    cancelled = asyncio.create_task(request())
    timed = asyncio.create_task(request())
    await asyncio.sleep(0.05)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert holds.waiting == 1
    assert await asyncio.wait_for(timed, 5.0) is False  # placed anyway, not refused
    assert len(waits) == 1 and 0.3 <= waits[0][0] < 3.0 and waits[0][1] is False
    assert holds.waiting == 0 and not holds.must_wait("r1")

"""One contract for every prefix-index backend: memory (on a fake clock) and Redis (the real server).

Time: the memory index runs on a fake clock that tests advance; the Redis index uses Redis's own
clock, so its tests really sleep, and only ever assert "expired" after a sleep longer than the TTL
(sleeps never run short) or "still live" with a wide margin.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.common.blocks import HASH_SCHEME
from kvroute.router.index import MemoryIndex, PrefixIndex, RedisIndex, ReplicaSpec, memory
from tests.index_reference import ReferenceIndex

CHAIN = [0xFFFF_FFFF_FFFF_FFFF - i for i in range(12)]  # near 2**64: the encoding must be unsigned
OTHER_CHAIN = list(range(1000, 1012))
TTL = 0.2


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """Builds indexes of one kind; ``advance`` lets at least ``dt`` seconds pass for them."""

    make: Callable[[float], PrefixIndex]
    advance: Callable[[float], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
def backend_kind(request) -> tuple[str, str | None, str | None]:
    """(kind, Redis URL, key prefix); a sync fixture, so Redis is only required for the Redis case."""
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
    return "memory", None, None


@pytest.fixture
async def backend(backend_kind):
    kind, url, prefix = backend_kind
    made: list[PrefixIndex] = []
    clock = FakeClock()

    def make(ttl: float) -> PrefixIndex:
        if kind == "memory":
            index: PrefixIndex = MemoryIndex(predicted_ttl_s=ttl, clock=clock)
        else:
            index = RedisIndex(url, key_prefix=prefix, predicted_ttl_s=ttl)
        made.append(index)
        return index

    async def advance(dt: float) -> None:
        if kind == "memory":
            clock.now += dt
        else:
            await asyncio.sleep(dt)

    yield Backend(make, advance)
    for index in made:
        await index.close()


async def index_with(backend: Backend, *specs: ReplicaSpec, ttl: float = TTL) -> PrefixIndex:
    index = backend.make(ttl)
    for s in specs:
        await index.add_replica(s)
    return index


def spec(name: str, capacity: int = 1000, events: bool = False) -> ReplicaSpec:
    return ReplicaSpec(name, capacity, events)


# -- leading-run semantics -----------------------------------------------------------------
async def test_unknown_chain_and_empty_chain_match_nothing(backend):
    index = await index_with(backend, spec("a"))
    await index.record_prediction("a", CHAIN)
    assert await index.lookup(OTHER_CHAIN) == {}
    assert await index.lookup([]) == {}


async def test_each_replica_reports_its_own_leading_run(backend):
    index = await index_with(backend, spec("a"), spec("b"), spec("c", events=True))
    await index.confirm("a", CHAIN[:10])
    await index.record_prediction("b", CHAIN[:4])
    await index.record_prediction("c", CHAIN[1:8])  # everything but the first block
    assert await index.lookup(CHAIN) == {"a": 10, "b": 4}
    assert await index.lookup(CHAIN[:3]) == {"a": 3, "b": 3}


async def test_a_gap_stops_the_count(backend):
    index = await index_with(backend, spec("a", events=True), spec("b"))
    await index.confirm("a", CHAIN)
    await index.remove("a", [CHAIN[5]])
    await index.record_prediction("b", CHAIN[:3] + CHAIN[4:])  # holds block 4 onwards, not block 3
    assert await index.lookup(CHAIN) == {"a": 5, "b": 3}


async def test_a_gap_stops_the_count_across_confirmed_and_predicted_blocks(backend):
    index = await index_with(backend, spec("a", events=True))
    chain = list(range(1, 41))
    await index.confirm("a", chain[:20])
    await index.record_prediction("a", chain[20:28] + chain[29:])  # block 28 is missing
    assert await index.lookup(chain) == {"a": 28}


async def test_writes_for_unregistered_replicas_are_ignored(backend):
    index = await index_with(backend, spec("a"))
    await index.record_prediction("ghost", CHAIN)
    await index.confirm("ghost", CHAIN)
    assert await index.lookup(CHAIN) == {}
    assert await index.entry_count("ghost") == 0


# -- predicted vs confirmed, TTL -------------------------------------------------------------
async def test_predictions_expire_only_on_replicas_with_events(backend):
    index = await index_with(backend, spec("events", events=True), spec("silent"), spec("confirmed", events=True))
    await index.record_prediction("events", CHAIN)
    await index.record_prediction("silent", CHAIN)
    await index.confirm("confirmed", CHAIN)
    assert await index.lookup(CHAIN) == {"events": 12, "silent": 12, "confirmed": 12}
    await backend.advance(TTL * 1.5)
    assert await index.lookup(CHAIN) == {"silent": 12, "confirmed": 12}
    assert await index.entry_count("events") == 0
    assert await index.entry_count("silent") == 12


async def test_confirm_upgrades_a_prediction_so_it_does_not_expire(backend):
    index = await index_with(backend, spec("a", events=True))
    await index.record_prediction("a", CHAIN[:8])
    await index.confirm("a", CHAIN[:4])
    await index.record_prediction("a", CHAIN[:8])  # re-predicting must not demote a confirmed block
    await backend.advance(TTL * 1.5)
    assert await index.lookup(CHAIN) == {"a": 4}
    assert await index.entry_count("a") == 4


async def test_re_predicting_renews_the_ttl(backend):
    ttl = 0.5  # the "still live" check below needs a margin on a busy machine
    index = await index_with(backend, spec("a", events=True), ttl=ttl)
    await index.record_prediction("a", CHAIN)
    await index.record_prediction("a", OTHER_CHAIN)
    await backend.advance(ttl * 0.7)
    await index.record_prediction("a", OTHER_CHAIN)
    await backend.advance(ttl * 0.5)  # CHAIN is 1.2 TTL old, OTHER_CHAIN 0.5 TTL
    assert await index.lookup(CHAIN) == {}
    assert await index.lookup(OTHER_CHAIN) == {"a": 12}


# -- capacity ------------------------------------------------------------------------------
async def test_capacity_evicts_the_least_recently_touched(backend):
    index = await index_with(backend, spec("a", capacity=4))
    old, kept, new = [1, 2], [3, 4], [5, 6]
    await index.record_prediction("a", old)
    await index.record_prediction("a", kept)
    await index.record_prediction("a", old)  # touched again: now more recent than `kept`
    await index.record_prediction("a", new)
    assert await index.lookup(old) == {"a": 2}
    assert await index.lookup(kept) == {}
    assert await index.lookup(new) == {"a": 2}
    assert await index.entry_count("a") == 4


async def test_predictions_never_evict_confirmed_entries(backend):
    """Predictions and confirmed entries are bounded apart, each at the capacity: what the engine
    said it stores stays until its BlockRemoved, however many requests are in flight; confirmed
    entries past what the engine can hold are stale (lost events), the least recent go."""
    index = await index_with(backend, spec("a", capacity=4, events=True), ttl=600)
    await index.confirm("a", [1, 2, 3, 4])  # the engine's whole capacity
    await index.record_prediction("a", [5, 6])
    await index.record_prediction("a", [1, 7])  # block 1 stays confirmed
    assert await index.lookup([1, 2, 3, 4]) == {"a": 4}
    assert (await index.lookup([5, 6]), await index.lookup([1, 7])) == ({"a": 2}, {"a": 2})
    assert await index.entry_count("a") == 7
    await index.record_prediction("a", [8, 9, 10])  # six predictions: the two least recent go
    assert (await index.lookup([5]), await index.lookup([6]), await index.lookup([7])) == ({}, {}, {"a": 1})
    assert await index.lookup([1, 2, 3, 4]) == {"a": 4}
    await index.confirm("a", [11])  # five confirmed: the least recently written one goes
    assert await index.lookup([1, 2, 3, 4]) == {"a": 3}
    assert await index.lookup([11]) == {"a": 1}
    assert await index.entry_count("a") == 8


async def test_expired_predictions_do_not_take_capacity(backend):
    index = await index_with(backend, spec("a", capacity=3, events=True))
    await index.confirm("a", [1])
    await index.record_prediction("a", [2, 3])
    await backend.advance(TTL * 1.5)
    await index.confirm("a", [4, 5])  # fits once the two expired predictions are gone
    assert await index.lookup([1]) == {"a": 1}
    assert await index.entry_count("a") == 3


async def test_shrinking_capacity_keeps_the_most_recent(backend):
    index = await index_with(backend, spec("a", capacity=10))
    for h in range(1, 9):
        await index.record_prediction("a", [h])
    await index.add_replica(spec("a", capacity=3))
    assert await index.entry_count("a") == 3
    assert [bool(await index.lookup([h])) for h in range(1, 9)] == [False] * 5 + [True] * 3


async def test_a_chain_counts_its_head_as_most_recent(backend):
    """Eviction takes a chain's tail first, as the engine does, not the head the run needs."""
    index = await index_with(backend, spec("a", capacity=5))
    await index.record_prediction("a", CHAIN)
    assert await index.entry_count("a") == 5
    assert await index.lookup(CHAIN) == {"a": 5}
    await index.record_prediction("a", OTHER_CHAIN[:2])  # evicts CHAIN's blocks 3 and 4
    assert await index.lookup(CHAIN) == {"a": 3}


# -- removal -------------------------------------------------------------------------------
async def test_remove_clear_and_remove_replica(backend):
    index = await index_with(backend, spec("a", events=True), spec("b"))
    await index.confirm("a", CHAIN)
    await index.confirm("b", CHAIN)
    await index.remove("a", CHAIN[6:])
    assert await index.lookup(CHAIN) == {"a": 6, "b": 12}
    assert await index.entry_count("a") == 6

    await index.clear_replica("a")  # the replica stays registered
    assert await index.lookup(CHAIN) == {"b": 12}
    await index.confirm("a", CHAIN[:2])
    assert await index.lookup(CHAIN) == {"a": 2, "b": 12}

    await index.remove_replica("b")  # gone: entries dropped, later writes ignored
    await index.confirm("b", CHAIN)
    assert await index.lookup(CHAIN) == {"a": 2}
    assert await index.entry_count("b") == 0
    await index.add_replica(spec("b"))
    assert await index.entry_count("b") == 0


async def test_drop_confirmed_keeps_predictions(backend):
    index = await index_with(backend, spec("events", events=True), spec("silent"))
    await index.record_prediction("events", CHAIN[:4])
    await index.confirm("events", CHAIN[4:])
    await index.record_prediction("silent", CHAIN[:6])
    await index.confirm("silent", CHAIN[6:])
    assert await index.lookup(CHAIN) == {"events": 12, "silent": 12}  # runs across both states
    await index.drop_confirmed("events")
    await index.drop_confirmed("silent")
    assert await index.lookup(CHAIN) == {"events": 4, "silent": 6}
    assert await index.entry_count("events") == 4
    assert await index.entry_count("silent") == 6


async def test_entry_count_counts_each_replica_separately(backend):
    index = await index_with(backend, spec("a"), spec("b", events=True))
    await index.record_prediction("a", CHAIN)
    await index.record_prediction("a", CHAIN[:5])  # the same blocks again: no new entries
    await index.confirm("b", CHAIN[:7])
    await index.record_prediction("b", CHAIN)
    assert (await index.entry_count("a"), await index.entry_count("b")) == (12, 12)


async def test_long_chains_and_many_replicas(backend):
    """Scripts must cope with chains past their chunk size and with 64 replicas."""
    chain = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 3001)]
    replicas = (spec(f"r{i}", capacity=5000, events=i % 2 == 0) for i in range(64))
    index = await index_with(backend, *replicas, ttl=600)  # no expiry while 64 chains are written
    depths = {f"r{i}": 1 + i * 46 for i in range(64)}  # 1 … 2899 blocks
    for name, depth in depths.items():
        await index.record_prediction(name, chain[:depth])
    await index.confirm("r63", chain)
    assert await index.lookup(chain) == depths | {"r63": 3000}
    await index.remove("r62", chain[2000:2001])
    assert (await index.lookup(chain))["r62"] == 2000


# -- Redis only: sharing and key layout ------------------------------------------------------
async def test_two_redis_indexes_on_one_prefix_share_everything(redis_url, redis_prefix):
    first = RedisIndex(redis_url, key_prefix=redis_prefix, predicted_ttl_s=TTL)
    second = RedisIndex.from_url(redis_url, key_prefix=redis_prefix, predicted_ttl_s=TTL)
    other_shard = RedisIndex(redis_url, key_prefix=redis_prefix, shard="other-model")
    try:
        await first.add_replica(spec("a", capacity=50, events=True))
        await first.record_prediction("a", CHAIN)
        assert await second.lookup(CHAIN) == {"a": 12}
        await second.confirm("a", CHAIN[:3])
        await asyncio.sleep(TTL * 1.5)
        assert await first.lookup(CHAIN) == {"a": 3}
        assert await second.replicas() == {"a": ReplicaSpec("a", 50, True)}
        assert await other_shard.lookup(CHAIN) == {}
    finally:
        for index in (first, second, other_shard):
            await index.close()


async def test_redis_keys_carry_prefix_and_scheme(redis_url, redis_prefix):
    index = RedisIndex(redis_url, key_prefix=redis_prefix)
    try:
        for s in (spec("a", events=True), spec("b")):
            await index.add_replica(s)
            await index.record_prediction(s.name, CHAIN)
        await index.confirm("a", CHAIN)
        keys = [k.decode() async for k in index.client.scan_iter(match=f"{redis_prefix}*")]
        base = f"{redis_prefix}:{{{HASH_SCHEME}}}:"
        assert all(k.startswith(base) for k in keys)
        # no x: a's TTL predictions were all confirmed, b's never expire
        assert sorted(k.removeprefix(base) for k in keys) == ["c:a", "cap", "ev", "l:a", "l:b", "p:b", "seq"]
        with pytest.raises(ValueError):
            RedisIndex(index.client, key_prefix="bad{tag}")
    finally:
        await index.close()


# -- memory only: the holder masks -----------------------------------------------------------
def assert_holders_match_entries(index: MemoryIndex) -> None:
    """The masks say exactly which replicas hold each block: no stale bit, and no block left with
    no holder (it would leak); each registered replica owns its bit."""
    expected: dict[int, int] = {}
    for rep in index._replicas.values():
        assert index._by_bit[rep.bit.bit_length() - 1] is rep
        for h in rep.entries:
            expected[h] = expected.get(h, 0) | rep.bit
    assert index._holders == expected


def memory_index(ttl: float = TTL) -> tuple[MemoryIndex, FakeClock]:
    clock = FakeClock()
    return MemoryIndex(predicted_ttl_s=ttl, clock=clock), clock


async def test_a_removed_replicas_bit_goes_to_the_next_replica_with_none_of_its_blocks():
    index, _ = memory_index()
    for name in "abc":
        await index.add_replica(spec(name))
    await index.record_prediction("a", CHAIN)
    await index.record_prediction("b", CHAIN[:6])
    await index.confirm("c", CHAIN[:3])
    freed = index._replicas["b"].bit
    await index.remove_replica("b")
    assert await index.lookup(CHAIN) == {"a": 12, "c": 3}
    await index.add_replica(spec("d"))
    assert index._replicas["d"].bit == freed  # the test is about reuse: make sure it happened
    assert await index.lookup(CHAIN) == {"a": 12, "c": 3}
    await index.record_prediction("d", CHAIN[:8])
    assert await index.lookup(CHAIN) == {"a": 12, "c": 3, "d": 8}
    await index.remove_replica("a")
    assert await index.lookup(CHAIN) == {"c": 3, "d": 8}
    assert_holders_match_entries(index)


async def test_eviction_expiry_removal_and_clearing_take_blocks_out_of_the_masks():
    index, clock = memory_index()
    await index.add_replica(spec("a", capacity=5))
    await index.add_replica(spec("b", events=True))
    await index.add_replica(spec("c", events=True))
    await index.record_prediction("a", CHAIN)  # over capacity: the tail is evicted at once
    await index.record_prediction("b", CHAIN)
    await index.confirm("c", CHAIN[:8])
    assert await index.lookup(CHAIN) == {"a": 5, "b": 12, "c": 8}
    clock.now += TTL * 1.5
    assert await index.lookup(CHAIN) == {"a": 5, "c": 8}
    assert not index._replicas["b"].entries  # the lookup itself purged b's expired predictions
    assert_holders_match_entries(index)
    await index.remove("c", CHAIN[3:4])
    assert await index.lookup(CHAIN) == {"a": 5, "c": 3}
    await index.drop_confirmed("c")
    await index.clear_replica("a")
    assert await index.lookup(CHAIN) == {}
    assert index._holders == {}


async def test_more_than_64_replicas():
    index, _ = memory_index(ttl=600)
    chain = list(range(1, 301))
    names = [f"r{i}" for i in range(70)]
    for i, name in enumerate(names):
        await index.add_replica(spec(name, events=i % 3 == 0))
    assert max(rep.bit for rep in index._replicas.values()).bit_length() == 70
    depths = {name: 1 + i * 37 % 300 for i, name in enumerate(names)}  # 70 different depths, 1 to 300
    for name, depth in depths.items():
        await index.record_prediction(name, chain[:depth])
    await index.confirm("r69", chain)
    depths["r69"] = 300
    assert await index.lookup(chain) == depths
    await index.remove("r68", chain[5:6])
    depths["r68"] = min(depths["r68"], 5)
    for gone in ("r3", "r40"):
        await index.remove_replica(gone)
        del depths[gone]
    await index.add_replica(spec("r70"))  # takes r3's bit
    await index.record_prediction("r70", chain[:50])
    depths["r70"] = 50
    assert await index.lookup(chain) == depths
    assert await index.lookup(chain[:1]) == dict.fromkeys(depths, 1)
    assert_holders_match_entries(index)


async def test_a_clock_that_steps_back_keeps_expiry_exact():
    """Predictions are purged in expiry order: one written after the clock stepped back expires
    before older ones, and must still go on time."""
    index, clock = memory_index(ttl=10)
    await index.add_replica(spec("a", events=True))
    await index.record_prediction("a", CHAIN)  # expires at 1010
    clock.now = 900
    await index.record_prediction("a", OTHER_CHAIN)  # expires at 910
    clock.now = 920
    assert await index.lookup(OTHER_CHAIN) == {}
    assert await index.lookup(CHAIN) == {"a": 12}
    assert_holders_match_entries(index)


async def test_re_predicting_within_the_slack_keeps_the_expiry_and_extends_the_chain():
    """A conversation re-predicted on every turn renews its blocks' expiry once per slack, not per
    request: within the slack the held blocks keep theirs (and their LRU place moves), new blocks
    get a full TTL, confirmed ones stay confirmed; past the slack all are renewed."""
    index, clock = memory_index(ttl=8)  # slack: 1
    await index.add_replica(spec("a", events=True))
    entries = index._replicas["a"].entries
    clock.now = 100
    await index.record_prediction("a", CHAIN[:6])
    await index.confirm("a", CHAIN[:2])
    clock.now = 100.5
    await index.record_prediction("a", CHAIN[:9])
    assert [entries[h] for h in CHAIN[:9]] == [-1.0] * 2 + [108] * 4 + [108.5] * 3
    assert list(entries)[-1] == CHAIN[0]  # the head is still the most recently used
    clock.now = 101.5  # past the slack: every prediction is renewed
    await index.record_prediction("a", CHAIN[:9])
    assert [entries[h] for h in CHAIN[:9]] == [-1.0] * 2 + [109.5] * 7
    clock.now = 108.2  # the first write's expiry (108) passed, the renewal's did not
    assert await index.lookup(CHAIN) == {"a": 9}
    clock.now = 109.6
    assert await index.lookup(CHAIN) == {"a": 2}  # the confirmed head only
    assert_holders_match_entries(index)


# -- property: random operation sequences against the reference model (tests/index_reference.py)
# Five replicas, chains long enough for the memory index's probes (blocks 8, 16, 32) and the
# bisection after them; two chains share a head, as conversations share a system prompt.
NAMES = ["r0", "r1", "r2", "r3", "r4"]
START_CAPACITIES = [4, 40, 12, 45, 30]  # small ones: eviction meets expiry often
LONG = list(range(1, 41))
BASE_CHAINS = [LONG, LONG[:20] + list(range(100, 116)), [2**64 - 1, 2**63, 12]]
chains = st.one_of(
    st.builds(lambda base, n: base[:n], st.sampled_from(BASE_CHAINS), st.integers(0, 40)),
    # a chain with a hole: later lookups meet a gap anywhere
    st.builds(
        lambda base, n, gap: base[:gap] + base[gap + 1 : n],
        st.sampled_from(BASE_CHAINS),
        st.integers(0, 40),
        st.integers(0, 39),
    ),
    st.lists(st.sampled_from(sorted({h for c in BASE_CHAINS for h in c})), max_size=6),
)
names = st.sampled_from(NAMES)
replica_specs = st.builds(ReplicaSpec, names, st.one_of(st.integers(0, 8), st.integers(20, 50)), st.booleans())


@pytest.mark.parametrize("gap", [1, 7, 8, 9, 12, 16, 17, 31, 32, 33, 63])
async def test_a_gap_anywhere_in_a_long_chain_stops_the_count(backend, gap):
    # the memory index probes blocks 8, 16, 32, ... before it scans: gaps on and between probes
    index = await index_with(backend, spec("a", events=True), spec("b"))
    chain = list(range(1, 71))
    await index.confirm("a", chain[:gap] + chain[gap + 1 :])
    await index.record_prediction("b", chain[:3])
    assert await index.lookup(chain) == {"a": gap, "b": 3}


common_ops = [
    st.tuples(st.just("add_replica"), replica_specs),
    st.tuples(st.just("remove_replica"), names),
    st.tuples(st.just("record_prediction"), names, chains),
    st.tuples(st.just("confirm"), names, chains),
    st.tuples(st.just("remove"), names, chains),
    st.tuples(st.just("clear_replica"), names),
    st.tuples(st.just("drop_confirmed"), names),
    st.tuples(st.just("entry_count"), names),
]
# Time moves in whole units around a TTL of 10, so expiry boundaries are hit exactly.
advance = st.tuples(st.just("advance"), st.sampled_from([3, 10]))
memory_ops = st.lists(st.one_of(*common_ops, advance), min_size=10, max_size=40)
redis_ops = st.lists(st.one_of(*common_ops), max_size=20)


async def check_against_reference(index: PrefixIndex, ops: list[tuple], ttl: float, clock: FakeClock | None) -> None:
    ref = ReferenceIndex(ttl)
    for name, capacity in zip(NAMES, START_CAPACITIES):
        s = ReplicaSpec(name, capacity, name not in ("r0", "r3"))
        ref.add_replica(s)
        await index.add_replica(s)
    for op, *args in ops:
        if op == "advance":
            ref.now += args[0]
            clock.now += args[0]
        elif op in ("record_prediction", "confirm"):
            ref.write(args[0], args[1], confirmed=op == "confirm")
            await getattr(index, op)(*args)
        elif op == "entry_count":  # an op of its own: the memory index purges when counting
            assert await index.entry_count(args[0]) == ref.entry_count(args[0]), args
        else:
            getattr(ref, op)(*args)
            await getattr(index, op)(*args)
        for chain in BASE_CHAINS:
            assert await index.lookup(chain) == ref.lookup(chain), (op, args)
        if isinstance(index, MemoryIndex):
            assert_holders_match_entries(index)
    for name in NAMES:
        assert await index.entry_count(name) == ref.entry_count(name), name


# A lookup tells runs apart with list.index when a run has few distinct holder masks, else with a
# running AND; 0 sends every lookup through the running AND, which five replicas rarely reach.
@pytest.mark.parametrize("few_holder_sets", [memory.FEW_HOLDER_SETS, 0])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=memory_ops)
async def test_memory_index_matches_the_reference(ops, few_holder_sets, monkeypatch):
    monkeypatch.setattr(memory, "FEW_HOLDER_SETS", few_holder_sets)
    clock = FakeClock()
    clock.now = 0.0
    await check_against_reference(MemoryIndex(predicted_ttl_s=10, clock=clock), ops, 10, clock)


_example_ids = itertools.count()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=redis_ops)
async def test_redis_index_matches_the_reference(ops, redis_url, redis_prefix):
    # One sub-prefix per example (still under redis_prefix, so the fixture cleans it up).
    # The TTL is long: nothing expires here; expiry on Redis is covered by the tests above.
    index = RedisIndex(redis_url, key_prefix=f"{redis_prefix}-{next(_example_ids)}", predicted_ttl_s=600)
    try:
        await check_against_reference(index, ops, 600, None)
    finally:
        await index.close()

"""Routing policies: the registry, each baseline's defining behaviour, the cost model's rules."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.placement.policy import ALL, BASELINES, POLICIES, Policy, ReplicaState, Query, make_policy
from kvroute.router.placement.policy.chwbl import ChwblPolicy, load_ok
from kvroute.router.placement.policy.cost_model import CostModelPolicy, SessionBook
from kvroute.router.placement.policy.prefix_heat import PrefixHeat
from kvroute.router.placement.policy.sglang_cache_aware import ApproxRadixTree, SglangCacheAwarePolicy, shared_prefix_len

BS = 16


def fleet(*loads: int) -> list[ReplicaState]:
    return [ReplicaState(name=f"r{i}", in_flight=n) for i, n in enumerate(loads)]


def request(
    blocks: int = 8,
    *,
    first: int = 1,
    matches: dict[str, int] | None = None,
    session: str | None = None,
    text: str = "",
) -> Query:
    chain = list(range(first, first + blocks))
    return Query(
        chain=chain,
        prompt_tokens=blocks * BS,
        block_size=BS,
        matches=matches or {},
        session_key=session,
        text=text,
    )


# --- registry ---------------------------------------------------------------------------------


def test_registry_names_and_order() -> None:
    assert BASELINES == ["round_robin", "least_loaded", "power_of_two", "chwbl", "sglang_cache_aware"]
    assert ALL == ["cost_model", *BASELINES]
    assert set(POLICIES) == {*ALL, "greedy_ttft"}
    for name in POLICIES:
        policy = make_policy(name, seed=7)
        assert policy.name == name
        assert isinstance(policy, POLICIES[name])


def test_make_policy_rejects_unknown_names_and_options() -> None:
    with pytest.raises(ValueError) as err:
        make_policy("fastest")
    for name in ALL:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="cost_model"):
        make_policy("cost_model", no_such_option=1)


def test_options_reach_the_policy() -> None:
    policy = make_policy("chwbl", load_factor=2.0, replication=8)
    assert isinstance(policy, ChwblPolicy)
    assert (policy.load_factor, policy.replication) == (2.0, 8)


# --- round robin, least loaded, power of two ---------------------------------------------------


def test_round_robin_cycles_over_the_eligible_replicas() -> None:
    policy = make_policy("round_robin")
    replicas = fleet(5, 0, 9)
    picks = [policy.choose(request(), replicas).replica for _ in range(7)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_least_loaded_picks_the_minimum_and_shares_ties() -> None:
    policy = make_policy("least_loaded", seed=1)
    assert {policy.choose(request(), fleet(3, 1, 2)).replica for _ in range(20)} == {"r1"}
    picks = Counter(policy.choose(request(), fleet(2, 0, 5, 0)).replica for _ in range(400))
    assert set(picks) == {"r1", "r3"}
    assert min(picks.values()) > 120  # both tied replicas get a fair share


def test_power_of_two_never_takes_the_worse_of_its_two() -> None:
    policy = make_policy("power_of_two", seed=3)
    assert {policy.choose(request(), fleet(4, 1)).replica for _ in range(50)} == {"r1"}
    # Distinct loads: the most loaded replica loses every pair it is in; the least loaded wins
    # every pair it is in, and is in one with probability 2/n.
    replicas = fleet(0, 1, 2, 3, 4)
    picks = Counter(policy.choose(request(), replicas).replica for _ in range(3000))
    assert "r4" not in picks
    assert 0.33 < picks["r0"] / 3000 < 0.47
    assert picks["r0"] > picks["r1"] > picks["r2"] > picks["r3"]


def test_power_of_two_is_reproducible_from_its_seed() -> None:
    replicas = fleet(0, 0, 0, 0, 0, 0)

    def run(seed: int) -> list[str]:
        p = make_policy("power_of_two", seed=seed)
        return [p.choose(request(), replicas).replica for _ in range(50)]

    assert run(5) == run(5)
    assert run(5) != run(6)


# --- chwbl ------------------------------------------------------------------------------------


def test_kubeai_load_bound_counts_the_new_request() -> None:
    # (15 + 1) / 4 * 1.25 = 5
    assert load_ok(5, 15, 4, 1.25)
    assert not load_ok(6, 15, 4, 1.25)
    assert load_ok(100, 0, 4, 1.25)  # an idle fleet accepts anything


def test_chwbl_same_key_same_replica_and_keys_spread() -> None:
    policy = make_policy("chwbl")
    replicas = fleet(0, 0, 0, 0)
    homes = {}
    for k in range(200):
        first = policy.choose(request(session=f"s{k}"), replicas).replica
        assert all(policy.choose(request(session=f"s{k}"), replicas).replica == first for _ in range(3))
        homes[k] = first
    assert set(homes.values()) == {"r0", "r1", "r2", "r3"}
    # No session key: the first block is the key, so the rest of the prompt does not matter.
    a = policy.choose(request(blocks=4, first=99), replicas).replica
    assert policy.choose(request(blocks=30, first=99), replicas).replica == a


def test_chwbl_moves_when_the_bound_is_exceeded() -> None:
    policy = make_policy("chwbl")
    idle = fleet(0, 0, 0, 0)
    home = policy.choose(request(session="alice"), idle)
    assert home.reason == "hash"
    busy = fleet(0, 0, 0, 0)
    by_name = {r.name: r for r in busy}
    by_name[home.replica].in_flight = 10  # (10+1)/4*1.25 = 3.44 < 10
    moved = policy.choose(request(session="alice"), busy)
    assert moved.replica != home.replica
    assert moved.reason == "balance"
    assert load_ok(by_name[moved.replica].in_flight, 10, 4, 1.25)
    by_name[home.replica].in_flight = 3  # (3+1)/4*1.25 = 1.25 < 3: still over
    assert policy.choose(request(session="alice"), busy).replica != home.replica
    by_name[home.replica].in_flight = 1  # (1+1)/4*1.25 = 0.625 < 1: KubeAI's bound is that tight
    assert policy.choose(request(session="alice"), busy).replica != home.replica
    for r in busy:
        r.in_flight = 2  # all equal: (8+1)/4*1.25 = 2.81 >= 2
    assert policy.choose(request(session="alice"), busy).replica == home.replica


def test_chwbl_remaps_only_the_removed_replicas_keys() -> None:
    policy = make_policy("chwbl")
    five = fleet(0, 0, 0, 0, 0)
    before = {k: policy.choose(request(session=f"k{k}"), five).replica for k in range(500)}
    four = [r for r in five if r.name != "r2"]
    after = {k: policy.choose(request(session=f"k{k}"), four).replica for k in range(500)}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "r2" for k in moved)
    assert set(moved) == {k for k in before if before[k] == "r2"}


def test_chwbl_keyless_requests_go_round_robin() -> None:
    policy = make_policy("chwbl")
    empty = Query(chain=[], prompt_tokens=5, block_size=BS)
    picks = [policy.choose(empty, fleet(0, 0, 0)) for _ in range(3)]
    assert [d.replica for d in picks] == ["r0", "r1", "r2"]
    assert {d.reason for d in picks} == {"round_robin"}


# --- sglang's approximate radix tree ------------------------------------------------------------


def test_shared_prefix_len() -> None:
    assert shared_prefix_len("hello world", 0, "help") == 3
    assert shared_prefix_len("xxhello", 2, "hello there") == 5
    assert shared_prefix_len("abc", 0, "xyz") == 0
    assert shared_prefix_len("abc", 0, "abcdef") == 3


def test_tree_records_text_per_tenant() -> None:
    tree = ApproxRadixTree()
    tree.insert("hello world", "A")
    assert tree.prefix_match("hello there") == (6, "A")
    tree.insert("help me", "B")  # splits "hello world" at "hel"
    assert tree.prefix_match("help me now") == (7, "B")
    assert tree.prefix_match("hello world") == (11, "A")
    assert tree.prefix_match("zzz")[0] == 0
    assert tree.tenant_chars == {"A": 11, "B": 7}
    assert tree.matched_chars("hello world", "B") == 3
    tree.remove_tenant("A")
    assert tree.prefix_match("hello world") == (3, "B")
    assert tree.tenant_chars == {"B": 7}


def _tree_sizes(tree: ApproxRadixTree) -> dict[str, int]:
    sizes: Counter[str] = Counter()
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for tenant in node.tenants:
            sizes[tenant] += len(node.text)
        stack.extend(node.children.values())
    return dict(sizes)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text("abc", max_size=12), st.sampled_from("XYZ")), max_size=25), st.text("abc", max_size=12))
def test_tree_matches_brute_force(inserts: list[tuple[str, str]], probe: str) -> None:
    tree = ApproxRadixTree()
    for text, tenant in inserts:
        tree.insert(text, tenant)
    counts = {t: c for t, c in tree.tenant_chars.items() if c}
    assert counts == {t: c for t, c in _tree_sizes(tree).items() if c}

    def lcp(a: str, b: str) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    best = max((lcp(probe, text) for text, _ in inserts), default=0)
    matched, tenant = tree.prefix_match(probe)
    assert matched == best
    if best:  # the tenant returned holds the whole matched prefix
        assert tree.matched_chars(probe, tenant) == best
        assert best == max(lcp(probe, t) for t, who in inserts if who == tenant)


def test_tree_eviction_drops_least_recently_used_leaves_to_the_budget() -> None:
    tree = ApproxRadixTree()
    shared = "S" * 20
    for k in range(10):
        tree.insert(shared + chr(ord("a") + k) * 10, "A")  # 20 + 10*10 chars
    assert tree.tenant_chars["A"] == 120
    tree.evict_tenant_by_size(55)
    assert tree.tenant_chars["A"] <= 55
    assert tree.tenant_chars == _tree_sizes(tree)
    assert tree.prefix_match(shared + "j" * 10)[0] == 30  # newest kept
    assert tree.prefix_match(shared + "a" * 10)[0] == 20  # oldest gone


# --- sglang cache_aware rule --------------------------------------------------------------------


def sgl(**kw: object) -> SglangCacheAwarePolicy:
    policy = make_policy("sglang_cache_aware", **kw)
    assert isinstance(policy, SglangCacheAwarePolicy)
    return policy


def test_sglang_sticks_to_the_tenant_above_the_match_ratio() -> None:
    policy = sgl()
    replicas = fleet(0, 0, 0)
    doc = "D" * 70
    first = policy.choose(request(text=doc + "q1" * 15), replicas)
    for r in replicas:
        r.in_flight = 0 if r.name != first.replica else 40  # busier, but within 64
    again = policy.choose(request(text=doc + "x" * 30), replicas)  # ratio 0.7
    assert (again.replica, again.reason) == (first.replica, "cache")
    # The tree recorded the request under the chosen replica.
    assert policy.tree.matched_chars(doc + "x" * 30, first.replica) == 100


def test_sglang_low_ratio_goes_to_the_least_loaded() -> None:
    policy = sgl()
    replicas = fleet(0, 0, 0)
    owner = policy.choose(request(text="P" * 30 + "a" * 70), replicas).replica
    for r in replicas:
        r.in_flight = {owner: 0}.get(r.name, 5)
    others = [r for r in replicas if r.name != owner]
    others[1].in_flight = 2
    low = policy.choose(request(text="P" * 30 + "b" * 70), replicas)  # ratio exactly 0.3: not above
    assert (low.replica, low.reason) == (owner, "load")  # owner is least loaded here
    for r in replicas:
        r.in_flight = {owner: 9}.get(r.name, 5)
    others[1].in_flight = 2
    low = policy.choose(request(text="P" * 30 + "c" * 70), replicas)
    assert (low.replica, low.reason) == (others[1].name, "load")


def test_sglang_old_rule_goes_to_the_smallest_tree() -> None:
    policy = sgl(low_match="smallest_tree")
    replicas = fleet(0, 0, 0)
    policy.tree.insert("x" * 50, "r0")
    policy.tree.insert("y" * 10, "r1")
    policy.tree.insert("z" * 30, "r2")
    decision = policy.choose(request(text="w" * 40), replicas)
    assert decision.replica == "r1"  # smallest tree, although every load is equal
    assert policy.tree.tenant_chars["r1"] == 50


@pytest.mark.parametrize(
    ("loads", "balance"),
    [
        ((100, 30, 50), True),  # 70 apart (> 64) and 100 > 30 * 1.5
        ((94, 30, 50), False),  # 64 apart: not above the absolute threshold
        ((300, 210, 250), False),  # 90 apart, but 300 <= 210 * 1.5: both conditions are needed
    ],
)
def test_sglang_balance_thresholds_override_the_cache(loads: tuple[int, ...], balance: bool) -> None:
    text = "T" * 100
    policy = sgl()
    replicas = fleet(0, 0, 0)
    assert policy.choose(request(text=text), replicas).replica == "r0"  # first on ties
    for r, n in zip(replicas, loads):
        r.in_flight = n
    d = policy.choose(request(text=text), replicas)
    if balance:
        assert (d.replica, d.reason) == ("r1", "balance")
        assert policy.tree.matched_chars(text, "r1") == 100  # recorded even then
    else:
        assert (d.replica, d.reason) == ("r0", "cache")


def test_sglang_evicts_on_the_callers_clock() -> None:
    policy = sgl(max_tree_size=100, eviction_interval_s=10.0)
    replicas = fleet(0)

    def send(k: int, now: float) -> None:
        req = request(text=chr(ord("a") + k) * 30)
        req = replace(req, now=now)
        policy.choose(req, replicas)

    for k in range(10):
        send(k, float(k))
    assert policy.tree.tenant_chars["r0"] == 300  # over budget, but no pass is due before t=10
    send(10, 10.0)  # the pass runs first (300 -> 90, oldest first), then the request is recorded
    assert policy.tree.tenant_chars["r0"] == 90 + 30
    assert policy.tree.prefix_match("a" * 30)[0] == 0
    assert policy.tree.prefix_match("j" * 30)[0] == 30


def test_sglang_forgets_a_replica() -> None:
    policy = sgl()
    replicas = fleet(0, 0)
    policy.choose(request(text="abcdef" * 10), replicas)
    policy.forget_replica("r0")
    assert "r0" not in policy.tree.tenant_chars
    d = policy.choose(request(text="abcdef" * 10), fleet(0, 0)[1:])
    assert d.replica == "r1"


def test_sglang_matched_worker_not_eligible_drops_its_tree() -> None:
    policy = sgl()
    text = "abcdef" * 10
    assert policy.choose(request(text=text), fleet(0, 0, 0)).replica == "r0"
    d = policy.choose(request(text=text), fleet(0, 0, 0)[1:])  # r0 unhealthy
    assert (d.replica, d.reason) == ("r1", "fallback")
    assert "r0" not in policy.tree.tenant_chars  # sglang wipes the stale tenant...
    assert policy.tree.matched_chars(text, "r1") == 0  # ...and does not record the request


def test_sglang_reports_its_own_belief_in_blocks() -> None:
    policy = sgl()
    replicas = fleet(0, 0)
    text = "k" * (10 * BS)
    policy.choose(request(blocks=10, text=text), replicas)
    d = policy.choose(request(blocks=12, text=text + "m" * (2 * BS)), replicas)
    assert d.reason == "cache" and d.matched_blocks == 10


# --- cost model ---------------------------------------------------------------------------------


def test_cost_model_prefers_the_replica_holding_the_prefix() -> None:
    policy = make_policy("cost_model")
    d = policy.choose(request(64, matches={"r2": 60, "r1": 10}), fleet(1, 1, 1, 1))
    assert (d.replica, d.reason, d.matched_blocks) == ("r2", "cache", 60)


def test_greedy_ttft_leaves_the_holder_when_its_queue_costs_more_than_a_fresh_prefill() -> None:
    replicas = fleet(1, 1, 1)
    holder = replicas[0]
    req = request(64, matches={"r0": 60})  # 1024 tokens, 64 uncached on r0
    policy = make_policy("greedy_ttft")  # leave once queue + 64 > 1024
    holder.queued_prefill_tokens = 900
    assert policy.choose(req, replicas).replica == "r0"
    holder.queued_prefill_tokens = 1000
    d = policy.choose(req, replicas)
    assert d.replica != "r0" and d.reason == "load"
    # Pricing the fresh prefill's delay to later requests (weight 3): queue + 3*64 vs 3*1024.
    patient = make_policy("greedy_ttft", own_work_weight=3.0)
    holder.queued_prefill_tokens = 2800
    assert patient.choose(req, replicas).replica == "r0"
    holder.queued_prefill_tokens = 2960
    assert patient.choose(req, replicas).replica != "r0"


def warmed(name: str = "cost_model", n: int = 4, requests: int = 200, **options: object) -> tuple[Policy, float]:
    """A policy that has routed ``requests`` unrelated ones (0.1 s apart) on an idle ``n``-replica
    fleet: past the cold start, every prefix it has not seen is a cold one.  Returns it and the
    clock."""
    policy = make_policy(name, **options)
    idle = fleet(*[0] * n)
    for k in range(requests):
        req = request(8, first=100_000 + 100 * k)
        req = replace(req, now=0.1 * k)
        policy.on_routed(req, policy.choose(req, idle))
    return policy, 0.1 * requests


def test_cost_model_prices_the_copy_a_departure_makes() -> None:
    # A follow-up held by r0 (60 of 64 blocks) while r0 has prefill queued: leaving builds a
    # second copy of 60 blocks, whose prefill the requests queued behind it on the new replica pay.
    greedy, now = warmed("greedy_ttft")
    fleet_cost, _ = warmed()
    replicas = fleet(1, 1, 1, 1)
    req = request(64, matches={"r0": 60})
    req = replace(req, now=now)
    replicas[0].queued_prefill_tokens = 2000  # more than a fresh 1024-token prefill elsewhere
    assert greedy.choose(req, replicas).replica != "r0"
    assert fleet_cost.choose(req, replicas).replica == "r0"
    # Not at any price: a queue far longer than the copy's cost to the fleet is left.
    replicas[0].queued_prefill_tokens = 50_000
    assert fleet_cost.choose(req, replicas).replica != "r0"


def test_cost_model_explores_when_the_new_part_outweighs_the_cached_one() -> None:
    # r0 holds a quarter of the prompt (a shared system prompt) behind a short queue: the copy
    # elsewhere would add more than it duplicates, so this request's own TTFT decides, as greedy.
    policy, now = warmed()
    replicas = fleet(1, 1, 1, 1)
    req = request(64, matches={"r0": 16})
    req = replace(req, now=now)
    replicas[0].queued_prefill_tokens = 1000  # 1000 + 768 uncached > 1024 fresh elsewhere
    assert policy.choose(req, replicas).replica != "r0"
    assert make_policy("greedy_ttft").choose(req, replicas).replica != "r0"
    # Holding most of the prompt, the same queue keeps it (the price of a copy is paid).
    most = request(64, first=7000, matches={"r0": 48})
    most = replace(most, now=now)
    replicas[0].queued_prefill_tokens = 1500  # 1500 + 256 > 1024: greedy would leave
    assert make_policy("greedy_ttft").choose(most, replicas).replica != "r0"
    assert policy.choose(most, replicas).replica == "r0"


def test_prefix_heat_keeps_sustained_traffic_and_forgets_a_burst() -> None:
    heat = PrefixHeat(tau_s=30.0, max_keys=4)
    for _ in range(10):  # a burst of "a" at t = 0
        heat.record(1, 0.0)
    assert heat.share(1, 0.0) == 1.0
    for k in range(300):  # then five minutes where every other request carries "b"
        heat.record(2 if k % 2 else None, float(k))
    assert heat.share(1, 300.0) < 0.01
    assert 0.4 < heat.share(2, 300.0) < 0.6
    for key in range(10, 14):  # more keys than it keeps: the least recent goes
        heat.record(key, 300.0)
    assert heat.share(2, 300.0) == 0.0 and heat.share(13, 300.0) > 0


def test_cost_model_replicates_a_prefix_whose_traffic_outgrows_its_holders() -> None:
    policy, now = warmed()
    replicas = fleet(1, 1, 1, 1)
    hot = request(64, matches={"r0": 60})
    cold = request(64, first=5000, matches={"r0": 60})
    replicas[0].queued_prefill_tokens = 2000
    cold = replace(cold, now=now)
    assert policy.choose(cold, replicas).replica == "r0"  # one request: no evidence, no copy
    # Half the traffic for 30 s carries the hot prefix: more than its one holder's fair share (1/4).
    picks = []
    for k in range(300):
        req = hot if k % 2 else request(8, first=200_000 + 100 * k)
        req = replace(req, now=now + 0.1 * k)
        picks.append(policy.choose(req, replicas).replica)
    assert picks[-1] != "r0"
    # Three quarters of the traffic: two holders of four still serve more than their share.
    two = request(64, matches={"r0": 60, "r1": 60})
    replicas[1].queued_prefill_tokens = 2000
    for k in range(300):
        req = two if k % 4 else request(8, first=300_000 + 100 * k)
        req = replace(req, now=now + 30 + 0.1 * k)
        d = policy.choose(req, replicas)
    assert d.replica not in ("r0", "r1")


def test_cost_model_a_cold_replica_back_in_the_fleet_takes_new_sessions_at_once() -> None:
    # Three replicas serve sessions that share a system prompt (16 of 64 blocks) when r3 comes back
    # from a restart: empty, idle, holding nothing, not even the system prompt.
    policy, now = warmed(n=3)
    busy = fleet(2, 2, 2)
    for r in busy:
        r.running = 2  # decoding, no prefill queued: a fresh prefill costs the same everywhere
    system = {r.name: 16 for r in busy}
    for k in range(12):
        req = request(64, first=1000 * k, matches=system, session=f"old{k}")
        req = replace(req, now=now + k)
        policy.on_routed(req, policy.choose(req, busy))
    back = ReplicaState(name="r3")
    replicas = [*busy, back]
    new = request(64, first=50_000, matches=system, session="new")
    new = replace(new, now=now + 13)
    assert policy.choose(new, replicas).replica == "r3"
    # The old sessions stay where their history is.
    old = request(64, first=0, matches={"r0": 60, "r1": 16, "r2": 16}, session="old0")
    old = replace(old, now=now + 14)
    assert policy.choose(old, replicas).replica == "r0"


def test_cost_model_rates_pooled_or_per_replica() -> None:
    replicas = fleet(1, 1, 1)
    holder = replicas[0]
    holder.prefill_rate = 40_000.0
    for r in replicas[1:]:
        r.prefill_rate = 10_000.0
    req = request(64, matches={"r0": 60})
    holder.queued_prefill_tokens = 4_000  # (4000 + 64) / 40k < 1024 / 10k: the fast holder wins
    assert make_policy("cost_model", per_replica_rates=True).choose(req, replicas).replica == "r0"
    # Pooled (the default): one median rate for all, so the queue alone decides.
    assert make_policy("cost_model").choose(req, replicas).replica != "r0"


def test_cost_model_sends_cold_requests_to_the_least_work() -> None:
    policy = make_policy("cost_model")
    replicas = fleet(2, 2, 2, 2)
    for r, q in zip(replicas, (500, 100, 900, 300)):
        r.queued_prefill_tokens = q
    assert {policy.choose(request(first=k * 100), replicas).replica for k in range(6)} == {"r1"}
    # Equal work: fewer requests in flight, then rotation among the fully tied.
    for r in replicas:
        r.queued_prefill_tokens = 0
    replicas[3].in_flight = 0
    assert policy.choose(request(), replicas).replica == "r3"
    replicas[3].in_flight = 2
    assert len({policy.choose(request(), replicas).replica for _ in range(8)}) == 4


def test_cost_model_bounded_load_rule() -> None:
    policy = make_policy("cost_model", epsilon=0.5, bound_floor=4)
    replicas = fleet(12, 0, 0, 0)  # bound = max(ceil(1.5 * 13 / 4), 4) = 5
    assert isinstance(policy, CostModelPolicy) and policy.load_bound(replicas) == 5
    d = policy.choose(request(64, matches={"r0": 64}), replicas)
    assert d.replica != "r0" and d.reason == "balance"
    replicas[0].in_flight = 3  # under the floor: the holder keeps it
    assert policy.choose(request(64, matches={"r0": 64}), replicas).replica == "r0"
    tight = make_policy("cost_model", epsilon=0.0, bound_floor=0)
    replicas = fleet(3, 2, 2, 2)  # bound = ceil(10 / 4) = 3: r0 would be at 4
    assert tight.choose(request(64, matches={"r0": 64}), replicas).reason == "balance"


def test_cost_model_keeps_a_long_held_prefix_past_the_bound() -> None:
    # bound = max(ceil(1.5 * 13 / 4), 4) = 5; r0 (12 in flight) is over it.
    policy = make_policy("cost_model", epsilon=0.5, bound_floor=4)
    assert isinstance(policy, CostModelPolicy) and policy.keep_tokens == 8192
    long = 8192 // BS  # blocks of one engine step's token budget
    d = policy.choose(request(2 * long, matches={"r0": long}), fleet(12, 0, 0, 0))
    assert (d.replica, d.reason, d.matched_blocks) == ("r0", "cache", long)  # half the prompt, 8k held
    # A shorter held prefix moves for the bound, as before.
    short = request(2 * long, first=10_000, matches={"r0": long - 1})
    assert policy.choose(short, fleet(12, 0, 0, 0)).reason == "balance"
    # The exemption is for the holders of the longest prefix only: a lesser holder stays bounded.
    d = policy.choose(request(2 * long, first=20_000, matches={"r0": long, "r1": long // 2}), fleet(0, 12, 12, 12))
    assert d.replica == "r0"
    two = request(2 * long, first=30_000, matches={"r0": long, "r1": long - 1})
    assert policy.choose(two, fleet(12, 12, 0, 0)).replica == "r0"  # r1 (long - 1 held) is bounded
    # The cost still decides: a holder whose queue costs more than the copy loses the request.
    busy = fleet(12, 0, 0, 0)
    busy[0].queued_prefill_tokens = 10 * 8192 * 2
    assert policy.choose(request(2 * long, first=40_000, matches={"r0": long}), busy).replica != "r0"
    # Off: the bound applies to every request (greedy_ttft, the previous default, keeps it so).
    off = make_policy("cost_model", epsilon=0.5, bound_floor=4, keep_tokens=None)
    assert off.choose(request(2 * long, first=50_000, matches={"r0": long}), fleet(12, 0, 0, 0)).reason == "balance"
    greedy = make_policy("greedy_ttft")
    assert isinstance(greedy, CostModelPolicy) and greedy.keep_tokens is None


def test_cost_model_session_hint_within_bounds_and_beyond() -> None:
    policy = make_policy("cost_model")
    replicas = fleet(1, 1, 1, 1)
    home = policy.choose(request(first=1, session="s"), replicas).replica
    by_name = {r.name: r for r in replicas}
    # The index forgot what home holds; home is a little busier than the rest: keep the session.
    by_name[home].queued_prefill_tokens = 100
    d = policy.choose(request(first=500, session="s"), replicas)
    assert (d.replica, d.reason) == (home, "session")
    # Much worse than the best: leave.
    by_name[home].queued_prefill_tokens = 5000
    d = policy.choose(request(first=600, session="s"), replicas)
    assert d.replica != home and d.reason == "load"
    # The session now lives where it went; over the load bound it moves again.
    new_home = d.replica
    assert isinstance(policy, CostModelPolicy) and policy.session_replica("s") == new_home
    for r in replicas:
        r.queued_prefill_tokens = 0 if r.name == new_home else 200
    assert policy.choose(request(first=700, session="s"), replicas).replica == new_home
    by_name[new_home].in_flight = 12  # bound = max(ceil(3 * 16 / 4), 4) = 12: the home would be at 13
    d = policy.choose(request(first=800, session="s"), replicas)
    assert d.replica != new_home and d.reason == "balance"


def test_cost_model_places_new_sessions_where_sessions_are_few() -> None:
    # Every first turn matches a system prompt that only r0 holds.
    replicas = fleet(0, 0, 0, 0)
    first_turn = {"r0": 4}
    spread = make_policy("cost_model", session_epsilon=0.0)  # at most the rounded-up mean
    homes = [spread.choose(request(matches=first_turn, session=f"s{k}"), replicas) for k in range(8)]
    assert Counter(d.replica for d in homes) == {"r0": 2, "r1": 2, "r2": 2, "r3": 2}
    assert homes[0].reason == "cache" and homes[1].reason == "balance"
    # The default bound, twice the mean, lets the system prompt's holder take more, not all.
    loose = make_policy("cost_model")
    counts = Counter(loose.choose(request(matches=first_turn, session=f"s{k}"), replicas).replica for k in range(8))
    assert 2 < counts["r0"] <= 4 and sum(counts.values()) == 8
    # Later turns follow their session, whatever the session counts.
    later = [spread.choose(request(first=900 + k, session=f"s{k}"), replicas) for k in range(8)]
    assert [d.replica for d in later] == [d.replica for d in homes]
    # Without the rule, the shared prompt alone would pull every session onto r0.
    greedy = make_policy("cost_model", session_epsilon=None)
    assert {greedy.choose(request(matches=first_turn, session=f"s{k}"), replicas).replica for k in range(8)} == {"r0"}


def test_session_book_counts_active_sessions() -> None:
    book = SessionBook(max_sessions=10, idle_s=120.0)
    book.touch("a", "r0", now=0.0)
    book.touch("b", "r0", now=50.0)
    book.touch("a", "r1", now=60.0)  # a moved
    assert (book.active("r0"), book.active("r1")) == (1, 1)
    book.expire(now=175.0)  # b idle since 50
    assert (book.active("r0"), book.active("r1")) == (0, 1)
    assert book.home("b") == "r0"  # idle sessions keep their home for the hint


def test_session_book_expects_the_turns_ended_sessions_had_left() -> None:
    book = SessionBook(max_sessions=100, idle_s=10.0)
    assert book.turns_left(3) == pytest.approx(2.0)  # the prior, before any session ended
    for k in range(40):  # 40 sessions of 6 turns each, then idle
        for t in range(6):
            book.touch(f"s{k}", "r0", now=float(t))
    assert book.turns("s0") == 6
    book.expire(now=100.0)
    assert book.turns("s0") == 0  # no longer active
    # after turn 3 of 6, 2 more follow; after 6 none do: the prior's weight is 10 sessions
    assert book.turns_left(3) == pytest.approx((2.0 * 10 + 2 * 40) / 50)
    assert book.turns_left(6) == pytest.approx(2.0)  # no ended session got that far


def slow_fleet(rates: tuple[float, ...], sampled_at: float = 0.0) -> list[ReplicaState]:
    return [ReplicaState(name=f"r{i}", prefill_rate=rate, rate_sampled_at=sampled_at) for i, rate in enumerate(rates)]


def test_cost_model_a_session_leaves_a_replica_that_serves_it_slowly() -> None:
    """Staying on its slow replica is cheaper for this turn (its history is cached there), moving
    is cheaper for the turns the session has left: the session moves.  On replicas whose rates
    differ only by noise it stays."""
    held = {"r0": 150}  # 2.4k tokens of history held by r0; the new turn adds ~300
    turn = request(169, matches=held, session="s")
    policy = make_policy("cost_model")
    policy.choose(request(150, session="s"), slow_fleet((20_000, 20_000, 20_000)))  # s lives on r0 now
    assert policy.session_replica("s") == "r0"
    assert policy.choose(turn, slow_fleet((14_000, 20_000, 26_000))).replica == "r0"  # noise: stays
    d = policy.choose(turn, slow_fleet((2_000, 20_000, 20_000)))  # 10x slower: leaves
    assert d.replica != "r0" and d.reason in ("load", "balance")
    off = make_policy("cost_model", slow_margin=None)
    off.choose(request(150, session="s"), slow_fleet((20_000, 20_000, 20_000)))
    assert off.choose(turn, slow_fleet((2_000, 20_000, 20_000))).replica == "r0"  # priced on the median rate


def test_cost_model_a_slow_replica_takes_no_new_sessions_until_its_verdict_fades() -> None:
    policy = make_policy("cost_model")
    assert isinstance(policy, CostModelPolicy)
    slow = slow_fleet((2_000, 20_000, 20_000))
    picks = Counter(policy.choose(request(first=100 * k, session=f"s{k}"), slow).replica for k in range(12))
    assert picks["r0"] == 0  # never "short of sessions", though it has none
    # no sample for a while: the verdict fades and the replica is probed like any other
    quiet_since = slow_fleet((2_000, 20_000, 20_000), sampled_at=-10 * policy.slow_memory_s)
    late = [policy.choose(Query(chain=list(range(5000 + 100 * k, 5008 + 100 * k)), prompt_tokens=128,
                                       block_size=BS, session_key=f"n{k}"), quiet_since).replica for k in range(6)]
    assert "r0" in late
    assert policy.slowness(quiet_since[0], 20_000.0, 0.0) == 1.0 < policy.slowness(slow[0], 20_000.0, 0.0)


def test_cost_model_feeds_a_starved_replica() -> None:
    # r0..r2 hold the hot prefix, r3 holds nothing and is never the cheapest.
    replicas = fleet(6, 6, 6, 0)  # bound = max(ceil(3 * 19 / 4), 4) = 15: all qualify
    hot = {"r0": 8, "r1": 8, "r2": 8}
    policy = make_policy("cost_model")
    picks = [policy.choose(request(matches=hot), replicas) for _ in range(80)]
    fed = [k for k, d in enumerate(picks) if d.replica == "r3"]
    assert fed == [33, 66]  # once per 8 * n decisions
    assert {picks[k].reason for k in fed} == {"balance"}
    off = make_policy("cost_model", starve_window=0)
    assert all(off.choose(request(matches=hot), replicas).replica != "r3" for _ in range(80))
    quiet = fleet(1, 1, 1, 0)  # under the floor: nothing to relieve
    assert all(policy.choose(request(matches=hot), quiet).replica != "r3" for _ in range(80))


def test_cost_model_session_memory_is_bounded_and_forgets_replicas() -> None:
    policy = make_policy("cost_model", max_sessions=2)
    assert isinstance(policy, CostModelPolicy)
    replicas = fleet(0, 0, 0)
    for s in ("a", "b", "c"):
        policy.choose(request(session=s), replicas)
    assert policy.session_replica("a") is None
    held = policy.session_replica("c")
    assert held is not None
    policy.forget_replica(held)
    assert policy.session_replica("c") is None


def test_cost_model_decode_penalty_is_a_tie_breaker() -> None:
    policy = make_policy("cost_model")
    quiet, busy = fleet(0, 0)
    busy.running = 40
    req = request(64)
    assert policy.choose(req, [busy, quiet]).replica == quiet.name
    # ...but it never outweighs a real cache hit: half the prompt cached on the busy replica.
    half = request(64, matches={busy.name: 32})
    assert policy.choose(half, [busy, quiet]).replica == busy.name


# --- every policy, any state --------------------------------------------------------------------

replica_states = st.builds(
    ReplicaState,
    name=st.just(""),
    in_flight=st.integers(0, 200),
    queued_prefill_tokens=st.integers(0, 50_000),
    running=st.integers(0, 200),
    prefill_rate=st.sampled_from([0.0, 2_000.0, 10_000.0, 50_000.0]),
)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(ALL),
    states=st.lists(replica_states, min_size=1, max_size=6),
    requests=st.lists(
        st.tuples(
            st.integers(0, 40),  # blocks
            st.integers(0, 40),  # matched blocks (may exceed the chain: index noise)
            st.sets(st.integers(0, 5)),  # which replicas match
            st.one_of(st.none(), st.sampled_from(["s1", "s2", "s3"])),
            st.text("ab", max_size=30),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_every_policy_returns_one_of_the_given_replicas(
    name: str, states: list[ReplicaState], requests: list[tuple[int, int, set[int], str | None, str]]
) -> None:
    for i, s in enumerate(states):
        s.name = f"r{i}"
    names = {s.name for s in states}
    policy = make_policy(name, seed=1)
    for t, (blocks, m, holders, session, text) in enumerate(requests):
        req = Query(
            chain=list(range(7, 7 + blocks)),
            prompt_tokens=blocks * BS + 3,
            block_size=BS,
            matches={f"r{h}": m for h in holders if m},
            session_key=session,
            text=text,
            now=float(t * 40),
        )
        d = policy.choose(req, states)
        assert d.replica in names
        assert d.matched_blocks >= 0 and d.reason in policy.reasons  # metrics pre-create these series
        policy.on_routed(req, d)
        if len(states) == 1:
            assert d.replica == "r0"


def test_only_policies_that_declare_it_read_the_text() -> None:
    # Same requests with and without their text: a policy that does not need it decides alike.
    texts = ["alpha " * 40, "alpha " * 39 + "beta", "gamma " * 40, "alpha " * 40 + "delta"]

    def picks(name: str, with_text: bool) -> list[str]:
        policy = make_policy(name, seed=3)
        replicas = fleet(0, 1, 1)
        out = []
        for k, text in enumerate(texts * 3):
            req = request(8, first=10 * k, text=text if with_text else "")
            d = policy.choose(req, replicas)
            policy.on_routed(req, d)
            out.append(d.replica)
            replicas[0].in_flight, replicas[1].in_flight = 1, 0  # r0 got the first: r1 is least loaded
        return out

    for name, cls in POLICIES.items():
        if not cls.needs_text:
            assert picks(name, True) == picks(name, False), name
    assert {name for name, cls in POLICIES.items() if cls.needs_text} == {"sglang_cache_aware"}
    assert picks("sglang_cache_aware", True) != picks("sglang_cache_aware", False)


def test_bounded_load_keeps_the_least_loaded_eligible() -> None:
    # The bound is never empty: the least loaded replica is always within it.
    policy = make_policy("cost_model", epsilon=0.0, bound_floor=0)
    assert isinstance(policy, CostModelPolicy)
    for loads in [(0, 0), (5, 0, 0), (7, 7, 8), (100, 1, 1, 1)]:
        replicas = fleet(*loads)
        assert min(loads) + 1 <= policy.load_bound(replicas)

"""Fleet simulator end to end: real policies, real index, real emulated engines, tiny fleets."""

import dataclasses
import json
import math

import numpy as np
import pytest

from kvroute.bench import sim_cli
from kvroute.bench.limit import LIMIT_KEYS, isolated_ttft
from kvroute.bench.reuse_loss import LOSS_KEYS, AuditedSim, audit
from kvroute.bench.sim import METRIC_KEYS, FleetConfig, FleetSim, drive, offered_load_rate, prepare, simulate_policy
from kvroute.bench.workloads import ConversationConfig, SessionsConfig, build_workload
from kvroute.replica.emulated.engine import EmulatedEngine, EngineRequest
from kvroute.replica.emulated.profile import DEFAULT_PROFILE, PROFILES
from kvroute.router.placement.policy import make_policy

BS = DEFAULT_PROFILE.block_size


# Quick conversations, no warm start: a few seconds of virtual time hold several turns each.
QUICK = SessionsConfig(first_message_median=800, reply_tokens=(10, 40), think_min_s=0.1, think_mean_s=0.3, warm_start=False)


@pytest.fixture(scope="module")
def sessions():
    return prepare(build_workload("sessions", seed=5, requests=80, rate=12.0, sessions=QUICK), BS)


def run(prepared, policy, replicas=3, **cfg):
    return FleetSim(prepared, make_policy(policy, seed=1), FleetConfig(replicas, DEFAULT_PROFILE, **cfg))


@pytest.mark.parametrize("policy", ["round_robin", "cost_model"])
def test_tiny_fleet_serves_every_request_with_consistent_figures(sessions, policy):
    fleet = run(sessions, policy)
    result = fleet.simulate()
    m = result.metrics()
    assert set(m) == set(METRIC_KEYS)
    routed = result.replica >= 0
    # Every request sent completed; only turns released after the window were not sent.
    assert m["requests"] == routed.sum() > 40
    assert not np.isnan(result.finish[routed]).any()
    assert (result.first_token[routed] <= result.finish[routed]).all()
    assert (result.first_token[routed] >= result.arrival[routed]).all()
    counts = np.bincount(result.replica[routed], minlength=3)
    # An engine can only hit what an earlier request brought: never more than one shared cache would.
    assert (result.cached_tokens <= result.available * BS).all()
    assert 0 < m["reuse_delivered"] <= m["reuse_available"] <= 1
    assert 0 <= m["reuse_predicted"] <= 1
    assert (result.predicted_blocks <= result.full_blocks).all()
    assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"]
    assert m["imbalance"] == pytest.approx(counts.max() / counts.mean())
    assert m["throughput_rps"] == pytest.approx(routed.sum() / (np.nanmax(result.finish) - np.nanmin(result.arrival)))
    if policy == "round_robin":
        assert counts.max() - counts.min() <= 1
    # KV events reached the index: it holds confirmed blocks, and predictions, each class at most
    # a replica's capacity.
    held = [drive(fleet.index.entry_count(name)) for name in fleet.names]
    assert sum(held) > 0 and max(held) <= 2 * DEFAULT_PROFILE.num_gpu_blocks


def test_closed_loop_turns_wait_for_the_previous_answer(sessions):
    result = simulate_policy(sessions, make_policy("least_loaded"), FleetConfig(2, DEFAULT_PROFILE))
    end = sessions.workload.end_s
    sent = cut = 0
    for r in sessions.workload.requests:
        if r.after is None:
            assert result.arrival[r.index] == r.arrival_s < end
            continue
        release = result.finish[r.after] + r.think_s  # NaN if the previous turn was cut too
        if release < end:
            sent += 1
            assert result.arrival[r.index] == pytest.approx(release)
        else:
            cut += 1
            assert result.replica[r.index] == -1 and np.isnan(result.arrival[r.index])
    assert sent > 10 and cut > 0


def test_runs_are_reproducible(sessions):
    a = run(sessions, "power_of_two").simulate()
    b = run(sessions, "power_of_two").simulate()
    assert a.metrics() == b.metrics()
    assert np.array_equal(a.replica, b.replica)


def test_random_prompts_have_nothing_to_reuse():
    prepared = prepare(build_workload("random", seed=1, requests=30, rate=5.0), BS)
    m = simulate_policy(prepared, make_policy("cost_model"), FleetConfig(2, DEFAULT_PROFILE)).metrics()
    assert m["requests"] == 30
    assert m["reuse_available"] == m["reuse_predicted"] == m["reuse_delivered"] == 0


def test_default_rate_scales_with_the_fleet_and_the_target_load():
    prepared = prepare(build_workload("handbook", seed=0, requests=200), BS)
    base = offered_load_rate(prepared, DEFAULT_PROFILE, replicas=4, load=0.75)
    bigger = offered_load_rate(prepared, DEFAULT_PROFILE, replicas=8, load=0.75)
    # Twice the replicas, twice the capacity, but each one builds its own copy of the document.
    assert base.rate < bigger.rate <= 2 * base.rate and bigger.miss_fraction >= base.miss_fraction
    assert offered_load_rate(prepared, DEFAULT_PROFILE, replicas=4, load=0.375).rate == pytest.approx(base.rate / 2)
    # One shared document: round-robin misses only the first copies and the questions.
    assert 0 < base.miss_fraction < 0.1
    rand = prepare(build_workload("random", seed=0, requests=100), BS)
    assert offered_load_rate(rand, DEFAULT_PROFILE, replicas=4).miss_fraction == pytest.approx(1.0)
    assert "75% of fleet prefill capacity under round_robin" in base.describe(4)


def test_cli_json_is_one_object_with_exactly_the_specified_keys(capsys):
    code = sim_cli.main(
        ["--workload", "handbook", "--replicas", "2", "--requests", "40", "--policy", "round_robin,cost_model", "--json"]
    )
    assert code == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)  # the whole of stdout is one JSON document
    assert out.strip().count("\n") == 0
    assert list(doc["policies"]) == ["round_robin", "cost_model"]
    for figures in doc["policies"].values():
        assert set(figures) == set(METRIC_KEYS)
        assert figures["requests"] == 40
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in figures.values())
    assert doc["workload"] == "handbook" and doc["replicas"] == 2 and doc["rate"] > 0
    limit = doc["limit"]
    assert set(limit) == set(LIMIT_KEYS) and 0 < limit["ttft_p50_s"] <= limit["ttft_p90_s"] <= limit["ttft_p99_s"]
    for figures in doc["policies"].values():
        assert figures["ttft_p50_s"] <= figures["ttft_p90_s"] <= figures["ttft_p99_s"]
        assert all(figures[k] >= limit[k] for k in LIMIT_KEYS)
    assert "of fleet prefill capacity under round_robin" in doc["rate_note"]
    assert "handbook" in err  # progress and notes go to stderr


def test_cli_table_and_plot(tmp_path, capsys):
    png = tmp_path / "sim.png"
    code = sim_cli.main(
        ["--workload", "random", "--replicas", "2", "--requests", "20", "--policy", "least_loaded", "--rate", "3", "--plot", str(png)]
    )
    assert code == 0
    out, _ = capsys.readouterr()
    assert "least_loaded" in out and "rate 3.00 req/s" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_unknown_policy():
    with pytest.raises(SystemExit):
        sim_cli.main(["--workload", "random", "--policy", "fastest"])


def test_without_kv_events_the_index_lives_on_predictions(sessions):
    fleet = run(sessions, "cost_model", replicas=2, kv_events=False)
    m = fleet.simulate().metrics()
    assert m["requests"] > 40 and 0 < m["reuse_delivered"] <= m["reuse_available"]
    # Predictions of replicas without events never expire: every routed chain is still there.
    held = [drive(fleet.index.entry_count(name)) for name in fleet.names]
    assert min(held) > 0


def test_requests_larger_than_the_kv_cache_are_not_sent():
    tiny = dataclasses.replace(PROFILES["cpu-tiny"], num_gpu_blocks=200)  # 3,200 tokens of KV
    prepared = prepare(build_workload("random", seed=3, requests=40, rate=2.0), tiny.block_size)
    outputs = np.array([r.max_tokens for r in prepared.workload.requests])
    too_long = (prepared.prompt_tokens + outputs - 1 + 15) // 16 > 200
    assert too_long.any() and not too_long.all()  # the random workload's long tail exceeds it
    result = simulate_policy(prepared, make_policy("round_robin"), FleetConfig(2, tiny))
    assert result.too_long == too_long.sum()
    assert result.metrics()["requests"] == 40 - too_long.sum()
    assert (result.replica[too_long] == -1).all()


@pytest.mark.parametrize(("prompt", "shared_blocks"), [(100, 0), (5000, 0), (20000, 300), (20000, 1250), (3200, 200)])
def test_the_limit_is_a_lone_request_on_an_idle_engine(prompt, shared_blocks):
    """An earlier request leaves `shared_blocks` of the prompt's chain cached and finishes; the
    request then arrives at the idle engine: its TTFT is the limit's formula, multi-chunk prefills
    (20k tokens > the 8192-token budget) and a block-aligned fully cached prompt included."""
    chain = list(range(1, prompt // BS + 1))
    engine = EmulatedEngine(DEFAULT_PROFILE)
    if shared_blocks:
        engine.submit(EngineRequest("warm", chain[:shared_blocks], shared_blocks * BS, 1), 0.0)
        engine.run_until(100.0)
    engine.submit(EngineRequest("probe", chain, prompt, 2), 100.0)
    first = next(u for u in engine.run_until(200.0) if u.kind == "first_token")
    assert first.time - 100.0 == pytest.approx(isolated_ttft(DEFAULT_PROFILE, prompt, shared_blocks, BS), rel=1e-12)


@pytest.mark.parametrize("policy", ["round_robin", "cost_model", "sglang_cache_aware"])
def test_no_policy_beats_the_physical_limit_on_any_request(sessions, policy):
    result = run(sessions, policy).simulate()
    sent = result.replica >= 0
    assert np.isnan(result.limit_ttft[~sent]).all() and not np.isnan(result.limit_ttft[sent]).any()
    ttft = result.first_token[sent] - result.arrival[sent]
    limit = result.limit_ttft[sent]
    assert (limit > 0).all()
    assert (ttft >= limit * (1 - 1e-9)).all()
    # Later turns re-send their history: the limit of most requests counts a cached prefix.
    full = np.array([isolated_ttft(DEFAULT_PROFILE, int(p), 0, BS) for p in result.prompt_tokens[sent]])
    assert (limit < full).mean() > 0.5


def test_conversation_outgrows_a_replicas_kv_cache():
    """Conversations minutes apart outgrow a replica's KV cache (the default profile's 444k
    tokens) within minutes at the default load (~1.8 req/s per replica): the engine evicts cached
    blocks, a quarter of its capacity and more within five minutes."""
    workload = build_workload("conversation", seed=1, requests=600, rate=1.8, sessions=ConversationConfig(warm_up_s=600.0))
    fleet = run(prepare(workload, BS), "round_robin", replicas=1)
    removed = []
    publish = fleet.engines[0].on_kv_event
    fleet.engines[0].on_kv_event = lambda ev: (removed.extend(getattr(ev, "block_hashes", ())) if type(ev).__name__ == "BlockRemoved" else None, publish(ev))
    m = fleet.simulate().metrics()
    assert m["requests"] > 250
    assert len(removed) > DEFAULT_PROFILE.num_gpu_blocks // 4


def test_reuse_loss_splits_what_the_caches_kept_from_what_the_choice_used(sessions):
    """bench/reuse_loss.py: round-robin leaves the engine holding a conversation on most turns,
    cost_model almost never; neither can find more in the caches than one shared infinite cache."""
    sums = {
        policy: audit(AuditedSim(sessions, make_policy(policy, seed=1), FleetConfig(3, DEFAULT_PROFILE)))
        for policy in ("round_robin", "cost_model")
    }
    for policy, s in sums.items():
        assert set(s) == set(LOSS_KEYS)
        assert 0 < s["delivered"] and s["fleet_held"] <= s["available"], policy
        assert 0 <= s["index_lost"] <= s["left_holder"] <= s["fleet_held"], policy
    rr, cm = sums["round_robin"], sums["cost_model"]
    assert rr["left_holder"] > rr["fleet_held"] / 10  # turns land where only the system prompt is
    assert cm["left_holder"] < rr["left_holder"] / 4
    # the same run through FleetSim delivers exactly what the audit counted
    plain = run(sessions, "cost_model").simulate()
    assert int((plain.cached_tokens // BS).sum()) == cm["delivered"]


def test_gate_sim_attributes_every_lost_block_and_sees_a_variant(tmp_path):
    """bench/gate_sim.py on a tenth of the gate's conversation workload: every block cost_model
    loses (available - delivered) is attributed to one cause, and a variant's options reach the
    policy (`queued_behind` 0, the greedy estimate, places differently)."""
    from kvroute.bench import gate_sim
    from kvroute.bench.gate.workloads import WORKLOADS, prepare_workload
    from kvroute.bench.routing_gate import parse_args as gate_args

    args = gate_args(["--workloads", "conversation", "--seed", "0", "--no-sim", "--requests-scale", "0.25"])
    prep = prepare_workload(WORKLOADS["conversation"], args, tmp_path, args.profile)
    lost = gate_sim.misses(prep)
    run = simulate_policy(prep.sim, make_policy("cost_model"), prep.cfg)
    missed = run.available[run.replica >= 0] - run.cached_tokens[run.replica >= 0] // run.block_size
    assert sum(b for b, _ in lost.values()) == int(missed[missed > 0].sum()) > 0
    assert any(cause.startswith("cost: explore") for cause in lost)
    out = tmp_path / "g.json"
    gate_sim.main(["--workloads", "conversation", "--seeds", "0", "--requests-scale", "0.25", "--json", str(out),
                   "--variant", 'plain=cost_model:{"queued_behind": 0}'])
    figures = json.loads(out.read_text())["results"]["conversation"]
    assert set(figures) == {"cost_model", "sglang_cache_aware", "plain"}
    assert all(0 < f[0]["reuse"] <= 100 for f in figures.values())
    assert figures["cost_model"] != figures["plain"]

"""Simulator workloads: deterministic from the seed, with the reuse structure each one claims."""

import json

import numpy as np
import pytest

from kvroute.bench.sim import available_blocks
from kvroute.bench.workloads import (
    TRACE_BLOCK_TOKENS,
    VOCAB_SIZE,
    ConversationConfig,
    SessionsConfig,
    build_workload,
    text_proxy,
    trace_block_tokens,
)
from kvroute.common.blocks import block_hashes, namespace_seed

SEED = namespace_seed("test-model")


def chains_of(workload, block_size=16):
    return [block_hashes(r.tokens(), block_size, SEED) for r in workload.requests]


def common_prefix(a, b):
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def signature(workload):
    return [
        (r.index, r.tokens().tobytes(), r.max_tokens, r.session_key, r.arrival_s, r.after, r.think_s)
        for r in workload.requests
    ]


@pytest.mark.parametrize("name", ["sessions", "handbook", "random"])
def test_same_seed_same_requests_other_seed_other_requests(name):
    a = build_workload(name, seed=7, requests=60)
    b = build_workload(name, seed=7, requests=60)
    c = build_workload(name, seed=8, requests=60)
    assert signature(a) == signature(b)
    assert signature(a) != signature(c)
    for r in a.requests:
        tokens = r.tokens()
        assert tokens.dtype == np.uint32 and tokens.size > 0 and int(tokens.max()) < VOCAB_SIZE
        assert r.max_tokens >= 1


def test_sessions_turns_extend_the_previous_prompt_and_wait_for_it():
    cfg = SessionsConfig()
    w = build_workload("sessions", seed=3, requests=300)
    by_index = {r.index: r for r in w.requests}
    sessions = set()
    followups = 0
    for r in w.requests:
        assert r.session_key is not None
        sessions.add(r.session_key)
        if r.after is None:
            assert r.arrival_s is not None
            continue
        followups += 1
        prev = by_index[r.after]
        assert prev.session_key == r.session_key
        assert r.arrival_s is None and r.think_s >= cfg.think_min_s
        before, now = prev.tokens(), r.tokens()
        # This turn re-sends the previous prompt, the reply to it (max_tokens long) and a new message.
        assert now.size > before.size + prev.max_tokens
        assert np.array_equal(now[: before.size], before)
    assert followups > len(sessions)  # several turns per session
    # Every session opens with one of a few shared system prompts: many first turns share a prefix.
    firsts = [r.tokens() for r in w.requests if r.after is None]
    heads = {f[: cfg.system_tokens[0]].tobytes() for f in firsts}
    assert 1 < len(heads) <= cfg.system_prompts < len(firsts)
    assert w.min_think_s >= cfg.think_min_s


def test_sessions_reuse_is_mostly_available_and_random_has_none():
    sessions = available_blocks(chains_of(build_workload("sessions", seed=0, requests=200)))
    rand_chains = chains_of(build_workload("random", seed=0, requests=200))
    assert sum(available_blocks(rand_chains)) == 0
    total = sum(len(c) for c in chains_of(build_workload("sessions", seed=0, requests=200)))
    assert sum(sessions) > 0.5 * total


def test_handbook_shares_one_document_and_varies_the_question():
    w = build_workload("handbook", seed=1, requests=50)
    prompts = [r.tokens() for r in w.requests]
    first = prompts[0]
    # The common prefix of all prompts is the document; what follows it differs every time.
    shared = min(common_prefix(first, p) for p in prompts[1:])
    assert 6000 <= shared <= 8000
    questions = {p[shared:].tobytes() for p in prompts}
    assert len(questions) == len(prompts) and b"" not in questions
    assert all(r.session_key is None and r.after is None for r in w.requests)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals)


def test_available_blocks_counts_leading_blocks_seen_before():
    chains = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 3, 6], [7, 2, 3], [5, 8]]
    assert available_blocks(chains) == [0, 2, 0, 3, 0, 1]


def test_text_proxy_keeps_token_prefixes_as_text_prefixes():
    a = np.array([1, 2, 3, 200_000 % VOCAB_SIZE, 5], dtype=np.uint32)
    b = np.array([1, 2, 3, 9], dtype=np.uint32)
    ta, tb = text_proxy(a), text_proxy(b)
    assert len(ta) == a.size and len(tb) == b.size
    assert ta[:3] == tb[:3] and ta[3] != tb[3]


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_hash_ids_give_shared_token_prefixes(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 7, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1800, "output_length": 0, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 2500, "input_length": 700, "output_length": 30, "hash_ids": [0, 9]},
        {"timestamp": 4000, "input_length": 512, "output_length": 5, "hash_ids": [4]},
    ]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    w = build_workload("trace", trace_path=trace, requests=10, time_scale=1.0)
    a, b, c, d = (r.tokens() for r in w.requests)
    assert [t.size for t in (a, b, c, d)] == [1200, 1800, 700, 512]
    assert np.array_equal(a, b[:1200])  # ids 0,1,2 shared; a's last block cut at 1200 tokens
    assert np.array_equal(a[:512], c[:512]) and not np.array_equal(a[512:700], c[512:700])
    assert not np.array_equal(a[:512], d)
    assert [r.max_tokens for r in w.requests] == [7, 1, 30, 5]  # at least one output token
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.5, 3.0]
    assert all(r.session_key is None for r in w.requests)
    # The block chains agree with the ids: a and b share every full block of a.
    ca, cb = block_hashes(a, 16, SEED), block_hashes(b, 16, SEED)
    assert ca == cb[: len(ca)] and len(ca) == 1200 // 16

    scaled = build_workload("trace", trace_path=trace, requests=10, time_scale=0.5)
    assert [r.arrival_s for r in scaled.requests] == [0.0, 0.25, 0.75, 1.5]
    at_rate = build_workload("trace", trace_path=trace, requests=10, rate=2.0)  # own rate: 3 req in 3 s
    assert at_rate.requests[-1].arrival_s == pytest.approx(1.5)
    assert len(build_workload("trace", trace_path=trace, requests=2).requests) == 2
    assert len(build_workload("trace", trace_path=trace, duration_s=1.0, time_scale=1.0).requests) == 2


def test_trace_block_tokens_depend_on_the_id_only():
    both = trace_block_tokens([5, 6])
    assert both.size == 2 * TRACE_BLOCK_TOKENS
    assert np.array_equal(both[TRACE_BLOCK_TOKENS:], trace_block_tokens([6]))
    assert np.array_equal(trace_block_tokens([5]), trace_block_tokens([5]))
    assert len(set(trace_block_tokens([5]).tolist())) > TRACE_BLOCK_TOKENS * 0.9  # not a constant fill


def test_rate_and_duration_shape_the_run():
    slow = build_workload("handbook", seed=2, requests=100, rate=1.0)
    fast = build_workload("handbook", seed=2, requests=100, rate=4.0)
    assert fast.requests[-1].arrival_s == pytest.approx(slow.requests[-1].arrival_s / 4)
    assert fast.rate == pytest.approx(4.0)
    timed = build_workload("sessions", seed=2, duration_s=20.0, rate=10.0)
    starts = [r.arrival_s for r in timed.requests if r.after is None]
    assert starts and max(starts) < 20.0
    kept = {r.index for r in timed.requests}
    assert all(r.after in kept for r in timed.requests if r.after is not None)
    assert [r.index for r in timed.requests] == list(range(len(timed.requests)))


def test_sessions_warm_start_opens_mid_conversation_inside_the_window():
    warm = build_workload("sessions", seed=4, requests=400, rate=20.0)
    cold = build_workload("sessions", seed=4, requests=400, rate=20.0, sessions=SessionsConfig(warm_start=False))
    assert warm.end_s == pytest.approx(400 / 20.0) == cold.end_s
    for w in (warm, cold):
        assert all(0 <= r.arrival_s < w.end_s for r in w.requests if r.after is None)
    # Warm: conversations already under way at time 0, so some first turns sent are later turns
    # (their earlier turns fell before the window)...
    assert any(r.turn > 0 for r in warm.requests if r.after is None)
    assert all(r.turn == 0 for r in cold.requests if r.after is None)
    # ...and the early part of the window is as busy as the rest (cold: nothing before the first start).
    early = sum(1 for r in warm.requests if r.after is None and r.arrival_s < 2.0)
    assert early > sum(1 for r in cold.requests if r.after is None and r.arrival_s < 2.0)


SHORT_WARM_UP = ConversationConfig(warm_up_s=600.0)  # the default 30 min costs seconds to build


def test_conversation_is_many_long_tailed_sessions_minutes_apart_on_shared_system_prompts():
    cfg = SHORT_WARM_UP
    w = build_workload("conversation", seed=2, requests=600, rate=3.0, sessions=cfg)
    assert signature(w) == signature(build_workload("conversation", seed=2, requests=600, rate=3.0, sessions=cfg))
    assert signature(w)[:50] != signature(build_workload("conversation", seed=3, requests=600, rate=3.0, sessions=cfg))[:50]
    prompts = {r.index: r.tokens() for r in w.requests}
    sizes = np.array([p.size for p in prompts.values()])
    # Heavy-tailed contexts: from a few hundred tokens to tens of thousands, a long upper tail.
    assert sizes.min() < 1000 and sizes.max() > 20000
    assert np.percentile(sizes, 99) > 4 * np.percentile(sizes, 50)
    assert sizes.max() <= cfg.max_context_tokens
    # Many more sessions than replicas, turns minutes apart.
    sessions = {r.session_key for r in w.requests}
    assert len(sessions) > 100
    thinks = np.array([r.think_s for r in w.requests if r.after is not None])
    assert thinks.min() >= cfg.think_s.lo and np.median(thinks) > 30 and thinks.max() > 300
    assert w.min_think_s >= cfg.think_s.lo
    # A turn re-sends the previous prompt and its reply.
    by_index = {r.index: r for r in w.requests}
    for r in w.requests:
        if r.after is not None:
            before = prompts[r.after]
            assert prompts[r.index].size > before.size + by_index[r.after].max_tokens
            assert np.array_equal(prompts[r.index][: before.size], before)
    # Shared system prompts of several sizes, the popular ones opening many sessions.
    system = cfg.system_prompt_tokens(2)
    opened = [next(k for k, s in enumerate(system) if np.array_equal(p[: s.size], s)) for p in prompts.values()]
    counts = np.bincount(opened, minlength=len(system))
    assert (counts > 0).sum() >= 5 and counts[0] == counts.max()
    used_sizes = {system[k].size for k in set(opened)}
    assert min(used_sizes) <= 700 and max(used_sizes) >= 4000


def test_conversation_bursts_keep_the_mean_rate():
    cfg = ConversationConfig()
    grid = np.arange(0, 30 * cfg.burst_period_s, 1.0)
    multipliers = np.array([cfg.rate_multiplier(0, t) for t in grid])
    assert multipliers.mean() == pytest.approx(1.0, rel=1e-3)
    assert multipliers.max() / multipliers.min() == pytest.approx(cfg.burst_factor)
    starts = []
    for t in cfg.session_starts(0, 1.0, 0.0):
        if t >= grid[-1]:
            break
        starts.append(t)
    in_burst = np.array([cfg.rate_multiplier(0, t) > 1 for t in starts])
    assert len(starts) == pytest.approx(grid[-1], rel=0.05)  # one session a second on average
    share_of_time = cfg.burst_s / cfg.burst_period_s
    expected = share_of_time * multipliers.max()  # bursts' share of the starts
    assert in_burst.mean() == pytest.approx(expected, abs=0.04) and expected > 2 * share_of_time

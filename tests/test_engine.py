"""The emulated vLLM engine: prefix cache semantics, KV events, scheduling, timing, coalescing."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.replica.emulated import (
    CPU_TINY,
    DEFAULT_PROFILE,
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EmulatedEngine,
    EngineRequest,
    TimingProfile,
)
from kvroute.common.blocks import block_hashes

BS = 16
SEED = 12345
# Simple round numbers so that step times are easy to reason about; every test derives expected
# times from the profile rather than hard-coding them.
SMALL = TimingProfile(
    name="test", block_size=BS, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
    step_base_s=1e-3, weights_read_s=0.0, prefill_s_per_token=1e-5, decode_s_per_seq=1e-4,
    decode_s_per_kv_token=1e-7, prefill_s_per_attn_pair=1e-9,
)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def req(rid: str, tokens: list[int], max_tokens: int = 1, with_ids: bool = True,
        bs: int = BS) -> EngineRequest:
    return EngineRequest(rid, block_hashes(tokens, bs, SEED), len(tokens), max_tokens,
                         tokens if with_ids else None)


def drain(eng: EmulatedEngine) -> list:
    return eng.run_until(math.inf)


def of_kind(updates, kind: str) -> dict:
    return {u.request_id: u for u in updates if u.kind == kind}


def engine(profile: TimingProfile = SMALL, events: list | None = None, **kw) -> EmulatedEngine:
    return EmulatedEngine(profile, on_kv_event=events.append if events is not None else None, **kw)


# --- profile --------------------------------------------------------------------------------

def test_default_profile_is_calibrated_to_public_h100_figures():
    p = DEFAULT_PROFILE
    assert 25_000 <= p.prefill_tokens_per_s() <= 35_000  # ~50% MFU of 989 TFLOPS on 14 GFLOP/token
    assert 5e-3 <= p.decode_step_s(1, 1000) <= 8e-3  # 16 GB of weights at 3.35 TB/s, plus overhead
    assert 400_000 <= p.num_gpu_blocks * p.block_size <= 460_000  # (80 GB*0.9 - 16 GB) / 128 KiB
    # Decode attention: 128 KiB of K and V per cached token read at ~80% of 3.35 TB/s.
    assert p.decode_s_per_kv_token == pytest.approx(131072 / 3.35e12, rel=0.3)
    # Steps grow with batch size and with context.
    assert p.decode_step_s(256, 2000) > p.decode_step_s(64, 2000) > p.decode_step_s(64, 200)


def test_profiles_by_name_and_overrides():
    assert PROFILES["cpu-tiny"] is CPU_TINY and PROFILES[DEFAULT_PROFILE.name] is DEFAULT_PROFILE
    assert 1e-3 <= CPU_TINY.decode_step_s(8, 500) <= 20e-3  # a few ms: usable in real time
    small = DEFAULT_PROFILE.replace(num_gpu_blocks=100)
    assert small.num_gpu_blocks == 100 and small.step_time(10, 2, 30) == DEFAULT_PROFILE.step_time(10, 2, 30)
    assert dataclasses.replace(CPU_TINY, max_num_seqs=4).max_num_seqs == 4


# --- prefix cache hits -----------------------------------------------------------------------

def test_identical_block_aligned_prompt_hits_all_blocks_but_the_last():
    eng = engine()
    prompt = toks(0, 4 * BS)
    eng.submit(req("a", prompt), 0.0)
    assert of_kind(drain(eng), "first_token")["a"].cached_tokens == 0
    eng.submit(req("b", prompt), 1.0)
    ups = drain(eng)
    assert of_kind(ups, "first_token")["b"].cached_tokens == 3 * BS
    assert of_kind(ups, "finished")["b"].cached_tokens == 3 * BS
    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (8 * BS, 3 * BS)


def test_unaligned_prompt_hits_every_full_block():
    eng = engine()
    prompt = toks(0, 4 * BS + 6)
    eng.submit(req("a", prompt), 0.0)
    drain(eng)
    eng.submit(req("b", prompt), 1.0)
    assert of_kind(drain(eng), "first_token")["b"].cached_tokens == 4 * BS


def test_shared_prefix_hits_only_the_shared_part_even_while_its_owner_runs():
    eng = engine()
    prefix = toks(0, 3 * BS)
    eng.submit(req("a", prefix + toks(1000, 2 * BS), max_tokens=50), 0.0)
    eng.run_until(0.05)
    assert eng.num_running == 1
    eng.submit(req("b", prefix + toks(2000, 2 * BS + 5)), 0.05)
    ups = drain(eng)
    assert of_kind(ups, "first_token")["b"].cached_tokens == 3 * BS
    assert of_kind(ups, "finished").keys() == {"a", "b"}


def test_hit_on_a_block_in_use_shares_it():
    eng = engine()
    prompt = toks(0, 3 * BS)
    eng.submit(req("a", prompt, max_tokens=100), 0.0)
    eng.run_until(0.01)
    eng.submit(req("b", prompt, max_tokens=100), 0.01)
    eng.run_until(0.05)
    assert eng.num_running == 2
    first = block_hashes(prompt, BS, SEED)[0]
    shared = [b for b, h in enumerate(eng.pool.block_hash) if h == first]
    assert len(shared) == 1 and eng.pool.ref_count[shared[0]] == 2
    eng.check_invariants()


# --- free queue, eviction, KV events ---------------------------------------------------------

def test_free_blocks_keep_their_hashes_and_are_reused_least_recently_freed_first():
    events: list = []
    eng = engine(SMALL.replace(num_gpu_blocks=9), events)  # 8 usable: one is vLLM's null block
    a, b = toks(0, 3 * BS), toks(1000, 3 * BS)
    ha, hb = block_hashes(a, BS, SEED), block_hashes(b, BS, SEED)
    eng.submit(req("a", a), 0.0)
    drain(eng)
    eng.submit(req("b", b), 1.0)
    drain(eng)
    assert eng.kv_usage == 0 and eng.pool.num_cached == 6  # free, but still cached
    events.clear()
    # 4 blocks: the 2 never used, then a's blocks (freed before b's), tail first.
    eng.submit(req("c", toks(5000, 4 * BS)), 2.0)
    drain(eng)
    removed = [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
    assert removed == [ha[2], ha[1]]
    assert eng.pool.is_cached(ha[0]) and all(eng.pool.is_cached(h) for h in hb)
    # The evictions are announced before the blocks are stored again with c's content.
    assert [type(ev) for ev in events] == [BlockRemoved, BlockStored]
    # a's first block still hits (and leaves the free queue); its two new blocks evict b's, which
    # were freed next, tail first.
    events.clear()
    eng.submit(req("a2", a), 3.0)
    assert of_kind(drain(eng), "first_token")["a2"].cached_tokens == BS
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [[hb[2], hb[1]]]


def test_block_stored_events_follow_chunked_prefill_with_parents_and_tokens():
    events: list = []
    eng = engine(SMALL.replace(max_num_batched_tokens=2 * BS), events)
    prompt = toks(0, 5 * BS)
    h = block_hashes(prompt, BS, SEED)
    eng.submit(req("a", prompt), 0.0)
    seen = []
    while (t := eng.next_step_time()) is not None:
        eng.run_until(t)
        seen.append(len(events))
    assert seen == [1, 2, 3]  # one BlockStored per chunk, delivered when its step completes
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
        (h[0:2], None), (h[2:4], h[1]), (h[4:5], h[3])]
    assert events[1].token_ids == prompt[2 * BS:4 * BS] and events[2].block_size == BS
    events.clear()
    eng.submit(req("b", toks(7000, 2 * BS), with_ids=False), 1.0)
    drain(eng)
    assert [e.token_ids for e in events if isinstance(e, BlockStored)] == [[]]


def test_recomputed_last_block_is_cached_twice_like_vllm():
    events: list = []
    eng = engine(SMALL.replace(num_gpu_blocks=11), events)  # 10 usable: one is vLLM's null block
    prompt = toks(0, 4 * BS)
    h = block_hashes(prompt, BS, SEED)
    eng.submit(req("a", prompt), 0.0)
    drain(eng)
    events.clear()
    eng.submit(req("b", prompt), 1.0)
    drain(eng)
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [([h[3]], h[2])]
    assert eng.pool.num_cached == 5
    events.clear()
    # Fill the pool: one copy of h[3] is evicted (BlockRemoved) while the other still hits.
    eng.submit(req("c", toks(9000, 6 * BS)), 2.0)
    drain(eng)
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [[h[3]]]
    assert eng.pool.is_cached(h[3])
    eng.check_invariants()


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use_then_clears_everything():
    events: list = []
    eng = engine(events=events)
    prompt = toks(0, 4 * BS)
    eng.submit(req("a", prompt, max_tokens=20), 0.0)
    eng.run_until(0.02)
    assert eng.num_running == 1
    assert eng.reset_prefix_cache() is False
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    drain(eng)
    assert eng.reset_prefix_cache() is True
    assert isinstance(events[-1], AllBlocksCleared) and eng.pool.num_cached == 0
    eng.submit(req("b", prompt), 5.0)
    assert of_kind(drain(eng), "first_token")["b"].cached_tokens == 0


# --- scheduling and timing ------------------------------------------------------------------

def test_chunked_prefill_spans_steps_and_the_last_chunk_yields_the_first_token():
    p = SMALL.replace(max_num_batched_tokens=32)
    eng = engine(p)
    eng.submit(req("a", toks(0, 80)), 0.0)
    ends = []
    while (t := eng.next_step_time()) is not None:
        ends.append(t)
        ups = eng.run_until(t)
        if len(ends) < 3:
            assert ups == [] and eng.num_running == 1
    expected, t = [], 0.0
    for n, c in ((32, 0), (32, 32), (16, 64)):  # chunk, tokens computed before it
        t += p.step_time(n, 0, 0, n * c + n * (n + 1) // 2)
        expected.append(t)
    assert ends == pytest.approx(expected)


def test_ttft_grows_with_uncached_tokens():
    ttft = []
    big = SMALL.replace(max_num_batched_tokens=4096, num_gpu_blocks=65)  # 1024 tokens + the null block
    for n in (64, 256, 1024):
        eng = engine(big)
        eng.submit(req("a", toks(0, n)), 0.0)
        ttft.append(of_kind(drain(eng), "first_token")["a"].time)
    assert ttft[0] < ttft[1] < ttft[2]
    # A cached prefix takes most of the work away.
    eng = engine(big)
    eng.submit(req("warm", toks(0, 1024 - BS) + toks(50_000, BS)), 0.0)
    drain(eng)
    eng.submit(req("a", toks(0, 1024)), 10.0)
    hit = of_kind(drain(eng), "first_token")["a"]
    assert hit.cached_tokens == 1024 - BS and hit.time - 10.0 < ttft[2] / 5


def test_ttft_grows_with_the_queue_ahead():
    eng = engine(SMALL.replace(max_num_batched_tokens=128))
    for i in range(4):
        eng.submit(req(f"r{i}", toks(1000 * i, 128)), 0.0)
    first = of_kind(drain(eng), "first_token")
    times = [first[f"r{i}"].time for i in range(4)]
    assert times == sorted(times) and len(set(times)) == 4


def test_requests_wait_while_kv_is_full_and_proceed_later():
    eng = engine(SMALL.replace(num_gpu_blocks=11))  # 10 usable: one is vLLM's null block
    eng.submit(req("a", toks(0, 6 * BS), max_tokens=20), 0.0)  # 6 blocks, 8 at the end
    eng.submit(req("b", toks(1000, 6 * BS), max_tokens=20), 0.0)
    eng.run_until(eng.next_step_time())
    assert (eng.num_running, eng.num_waiting) == (1, 1)
    assert eng.kv_usage == pytest.approx(6 / 10)
    ups = drain(eng)
    fin, first = of_kind(ups, "finished"), of_kind(ups, "first_token")
    assert first["b"].time > fin["a"].time
    assert fin.keys() == {"a", "b"} and eng.num_preemptions == 0 and eng.kv_usage == 0


def test_max_num_seqs_bounds_the_running_set():
    eng = engine(SMALL.replace(max_num_seqs=2))
    for i in range(5):
        eng.submit(req(f"r{i}", toks(1000 * i, 32), max_tokens=5), 0.0)
    eng.run_until(eng.next_step_time())
    assert (eng.num_running, eng.num_waiting) == (2, 3)
    assert len(of_kind(drain(eng), "finished")) == 5


def test_a_running_request_that_cannot_grow_preempts_the_latest_admitted():
    eng = engine(SMALL.replace(num_gpu_blocks=10))
    eng.submit(req("a", toks(0, 4 * BS), max_tokens=40), 0.0)  # 7 blocks each at the end
    eng.submit(req("b", toks(1000, 4 * BS), max_tokens=40), 0.0)
    ups = []
    while (t := eng.next_step_time()) is not None:
        ups += eng.run_until(t)
        eng.check_invariants()
    assert eng.num_preemptions >= 1
    fin = of_kind(ups, "finished")
    assert fin["b"].time > fin["a"].time  # b was the one preempted and recomputed
    for rid in "ab":
        assert sum(u.new_tokens for u in ups if u.request_id == rid) == 40
    assert [u.kind for u in ups if u.request_id == "b"].count("first_token") == 1
    assert eng.generation_tokens_total == 80 and eng.kv_usage == 0


# --- coalescing -----------------------------------------------------------------------------

def _workload(seed: int, n: int, rate: float) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    prefixes = [toks(100_000 * (k + 1), rng.randrange(1, 6) * BS) for k in range(3)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tokens = rng.choice(prefixes) + toks(10_000_000 + 1000 * i, rng.randrange(1, 90))
        out.append((t, req(f"r{i}", tokens, max_tokens=rng.randrange(1, 80))))
    return out


def _replay(eng: EmulatedEngine, work, step_by_step: bool) -> list:
    ups = []
    for t, r in work:
        if step_by_step:
            while (nt := eng.next_step_time()) is not None and nt <= t:
                ups += eng.run_until(nt)
        ups += eng.run_until(t)
        eng.submit(r, t)
    if step_by_step:
        while (nt := eng.next_step_time()) is not None:
            ups += eng.run_until(nt)
    return ups + drain(eng)


@pytest.mark.parametrize("blocks,rate", [(400, 40.0), (24, 300.0)])  # ample KV; KV so tight that
def test_coalesced_decoding_gives_the_same_results_as_stepping_one_by_one(blocks, rate):  # requests wait and preempt
    work = _workload(7, 60, rate)
    runs = []
    for max_coalesce, step_by_step in ((None, False), (1, False), (1, True), (None, True)):
        events: list = []
        eng = engine(SMALL.replace(num_gpu_blocks=blocks), events, max_coalesce=max_coalesce)
        ups = _replay(eng, work, step_by_step)
        eng.check_invariants()
        flat = [(type(e).__name__, h) for e in events for h in getattr(e, "block_hashes", [None])]
        key = sorted((u.request_id, u.kind, u.time, u.cached_tokens) for u in ups if u.kind != "tokens")
        runs.append((key, flat, eng.generation_tokens_total, eng.prefix_cache_hits, eng.num_preemptions))
        if not step_by_step:  # (stepping by next_step_time() forms one step at a time)
            assert (eng.coalesced_steps > 0) == (max_coalesce is None)
        for r in (r for _, r in work):
            assert sum(u.new_tokens for u in ups if u.request_id == r.request_id) == r.max_tokens
    assert all(run == runs[0] for run in runs[1:])
    assert len(runs[0][0]) == 2 * len(work)
    if blocks == 24:
        assert runs[0][4] > 0  # the tight case did exercise preemption


def test_token_updates_are_aggregated_or_left_out():
    eng = engine()
    eng.submit(req("a", toks(0, 40), max_tokens=200), 0.0)
    ups = eng.run_until(0.1) + eng.run_until(0.2) + drain(eng)
    tokens = [u for u in ups if u.kind == "tokens"]
    assert 1 <= len(tokens) <= 3 and sum(u.new_tokens for u in ups) == 200
    assert [u.kind for u in ups][0] == "first_token" and ups[-1].kind == "finished"
    assert all(u.time <= limit for u, limit in zip(tokens, (0.1, 0.2, math.inf), strict=False))
    quiet = engine(emit_token_updates=False)
    quiet.submit(req("a", toks(0, 40), max_tokens=200), 0.0)
    assert [u.kind for u in drain(quiet)] == ["first_token", "finished"]
    assert quiet.generation_tokens_total == 200


# --- metrics, abort, validation -------------------------------------------------------------

def test_metric_counters_and_gauges():
    eng = engine()
    assert (eng.num_running, eng.num_waiting, eng.kv_usage) == (0, 0, 0.0)
    lens = [40, 70, 33]
    for i, n in enumerate(lens):
        eng.submit(req(f"r{i}", toks(1000 * i, n), max_tokens=10 + i), 0.0)
    assert eng.num_waiting == 3
    eng.run_until(eng.next_step_time())
    assert eng.num_running == 3 and eng.kv_usage > 0
    drain(eng)
    assert eng.prompt_tokens_total == eng.prefix_cache_queries == sum(lens)
    assert eng.generation_tokens_total == 10 + 11 + 12
    assert (eng.num_running, eng.num_waiting, eng.kv_usage) == (0, 0, 0.0)


def test_abort_frees_blocks_and_keeps_computed_blocks_cached():
    eng = engine(SMALL.replace(num_gpu_blocks=16))
    prompt = toks(0, 6 * BS)
    eng.submit(req("a", prompt, max_tokens=60), 0.0)
    eng.submit(req("w", toks(1000, 12 * BS)), 0.0)  # waits: KV is full
    eng.run_until(0.05)
    assert (eng.num_running, eng.num_waiting) == (1, 1)
    eng.abort("w", 0.05)
    eng.abort("a", 0.06)
    eng.abort("nobody", 0.06)
    ups = eng.run_until(0.07)
    aborted = of_kind(ups, "aborted")
    assert aborted.keys() == {"a", "w"} and aborted["a"].time == 0.06
    assert sum(u.new_tokens for u in ups if u.request_id == "a") > 1
    assert eng.kv_usage == 0 and eng.num_running == eng.num_waiting == 0
    eng.check_invariants()
    eng.submit(req("again", prompt), 1.0)
    assert of_kind(drain(eng), "first_token")["again"].cached_tokens == 5 * BS


def test_abort_during_the_step_that_would_produce_the_first_token():
    eng = engine()
    eng.submit(req("a", toks(0, 200)), 0.0)
    end = eng.next_step_time()
    eng.abort("a", end / 2)
    ups = drain(eng)
    assert [u.kind for u in ups] == ["aborted"] and eng.kv_usage == 0


def test_submit_validates_requests():
    eng = engine(SMALL.replace(num_gpu_blocks=5))  # 4 usable: one is vLLM's null block
    with pytest.raises(ValueError):
        eng.submit(req("big", toks(0, 4 * BS), max_tokens=2), 0.0)  # 65 tokens > 4 blocks
    eng.submit(req("ok", toks(0, 4 * BS)), 0.0)
    with pytest.raises(ValueError):
        eng.submit(req("ok", toks(0, BS)), 0.0)
    with pytest.raises(ValueError):
        eng.submit(EngineRequest("zero", [], 10, 0), 0.0)


# --- invariants under random use ------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("run"), st.floats(0.0, 0.05)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=60), blocks=st.integers(12, 40), coalesce=st.sampled_from([None, 1, 3]))
def test_reference_counts_and_free_queue_stay_consistent(ops, blocks, coalesce):
    bs = 4
    p = SMALL.replace(block_size=bs, num_gpu_blocks=blocks, max_num_seqs=4, max_num_batched_tokens=24)
    events: list = []
    eng = engine(p, events, max_coalesce=coalesce)
    prefixes = [toks(100_000 * (k + 1), 8 * k) for k in range(4)]
    t, submitted, ups = 0.0, {}, []
    for op in ops:
        if op[0] == "submit":
            _, k, suffix, max_tokens = op
            rid = f"r{len(submitted)}"
            r = req(rid, prefixes[k] + toks(10_000 * len(submitted), suffix), max_tokens, bs=bs)
            if -(-(r.prompt_tokens + max_tokens - 1) // bs) > blocks - 1:  # the null block holds nothing
                continue
            eng.submit(r, t)
            submitted[rid] = r
        elif op[0] == "abort":
            if submitted:
                eng.abort(f"r{op[1] % len(submitted)}", t)
        else:
            t += op[1]
            ups += eng.run_until(t)
        eng.check_invariants()
        assert eng.pool.num_cached <= blocks and 0 <= eng.kv_usage <= 1
    ups += drain(eng)
    eng.check_invariants()
    assert eng.kv_usage == 0
    ends = [u.request_id for u in ups if u.kind in ("finished", "aborted")]
    assert sorted(ends) == sorted(submitted)  # exactly one end each
    for rid, u in of_kind(ups, "finished").items():
        assert sum(v.new_tokens for v in ups if v.request_id == rid) == submitted[rid].max_tokens
    for u in ups:
        if u.kind == "first_token":
            assert u.cached_tokens % bs == 0 and u.cached_tokens < submitted[u.request_id].prompt_tokens

"""Live hit-rate breakdown: reuse available over a bounded window, cache-hostile prompt detection."""

from __future__ import annotations

import numpy as np

from kvroute.common.blocks import block_hashes, namespace_seed
from kvroute.router.request.reuse import SAMPLE, SMALL_TOKENS, WINDOW, ReuseTracker, fingerprints, small_fingerprints

BS = 16
SEED = namespace_seed("m")
rng = np.random.default_rng(7)


def _tokens(n: int) -> np.ndarray:
    return rng.integers(0, 50_000, n).astype(np.uint32)


def _observe(tracker: ReuseTracker, ids: np.ndarray, seed: int = SEED, model: str = "m"):
    return tracker.observe(model, block_hashes(ids, BS, seed), ids, BS, seed)


def test_available_is_the_leading_run_seen_before():
    t = ReuseTracker()
    system = _tokens(20 * BS)
    first = np.concatenate([system, _tokens(5 * BS)])
    assert _observe(t, first).available_blocks == 0
    second = np.concatenate([system, _tokens(7 * BS)])
    assert _observe(t, second).available_blocks == 20
    # a growing conversation: everything of the earlier turn is available
    third = np.concatenate([second, _tokens(3 * BS + 5)])
    assert _observe(t, third).available_blocks == len(second) // BS


def test_models_and_salts_do_not_share_reuse():
    t = ReuseTracker()
    ids = _tokens(10 * BS)
    _observe(t, ids)
    assert _observe(t, ids, model="other").available_blocks == 0
    salted = namespace_seed("m", cache_salt="tenant-b")
    assert _observe(t, ids, seed=salted).available_blocks == 0
    assert _observe(t, ids).available_blocks == 10


def test_window_is_bounded_and_forgets_least_recent():
    t = ReuseTracker(window_blocks=30)
    old = _tokens(20 * BS)
    _observe(t, old)
    _observe(t, _tokens(20 * BS))  # pushes 10 of old's blocks out, least recently seen first
    assert t.window_size("m") == 30
    assert _observe(t, old).available_blocks == 0  # its first blocks went first


def test_a_seen_prefix_is_refreshed_so_it_outlives_newer_prompts():
    t = ReuseTracker(window_blocks=30)
    system = _tokens(10 * BS)
    _observe(t, system)
    _observe(t, _tokens(15 * BS))
    # the system prompt again, with a new tail: its blocks become the most recent
    assert _observe(t, np.concatenate([system, _tokens(2 * BS)])).available_blocks == 10
    _observe(t, _tokens(15 * BS))  # evicts the 15 least recent: the first filler's, not the system's
    assert _observe(t, system).available_blocks == 10


def test_fingerprints_do_not_depend_on_position():
    body = _tokens(3000)
    a = set(fingerprints(body, SEED).tolist())
    b = set(fingerprints(np.concatenate([_tokens(7), body]), SEED).tolist())
    assert len(a) > 3000 // SAMPLE // 3  # about one window in SAMPLE is kept
    assert a <= b


def test_short_prompts_fingerprinted_without_numpy_give_the_same_values():
    rng = np.random.default_rng(5)
    kept = 0
    for trial in range(3000):
        n = int(rng.integers(WINDOW, SMALL_TOKENS + 1))
        high = 2**32 if trial % 2 else 200  # the largest ids, and a small vocabulary's repeats
        ids = rng.integers(0, high, n, dtype=np.uint64).astype(np.uint32)
        seed = SEED if trial % 3 else int(rng.integers(0, 2**63)) * 2 + 1
        expected = fingerprints(ids, seed).tolist()
        assert small_fingerprints(ids, seed) == expected
        assert small_fingerprints(ids.tolist(), seed) == expected
        kept += len(expected)
    assert kept > 3000 * WINDOW / SAMPLE / 2  # windows were kept: the values were compared, not just []


def test_timestamp_before_a_shared_system_prompt_is_cache_hostile():
    t = ReuseTracker()
    system = _tokens(1500)
    first = np.concatenate([_tokens(3), system, _tokens(50)])  # "Date: 10:00" + shared prompt
    assert not _observe(t, first).cache_hostile
    shifted = np.concatenate([_tokens(5), system, _tokens(60)])  # a new date, of another length
    seen = _observe(t, shifted)
    assert seen.available_blocks == 0 and seen.cache_hostile


def test_divergence_a_few_blocks_in_is_still_hostile():
    t = ReuseTracker(head_blocks=8)
    head, document = _tokens(2 * BS + 3), _tokens(2000)
    _observe(t, np.concatenate([head, _tokens(4), document]))  # "You are ... Today is <date>" + document
    seen = _observe(t, np.concatenate([head, _tokens(6), document]))
    assert seen.available_blocks == 2 and seen.cache_hostile
    # diverging late (after the head) is an ordinary continuation, not a hostile layout
    late = ReuseTracker(head_blocks=1)
    _observe(late, np.concatenate([head, _tokens(4), document]))
    assert not _observe(late, np.concatenate([head, _tokens(6), document])).cache_hostile


def test_new_prompts_and_continued_conversations_are_not_hostile():
    t = ReuseTracker()
    convo = _tokens(1200)
    assert not _observe(t, convo).cache_hostile
    assert not _observe(t, np.concatenate([convo, _tokens(100)])).cache_hostile  # first block seen
    assert not _observe(t, _tokens(1200)).cache_hostile  # nothing seen anywhere
    # a short shared stretch (a common phrase) is not a long one
    phrase = convo[600:640]
    assert not _observe(t, np.concatenate([_tokens(500), phrase, _tokens(500)])).cache_hostile


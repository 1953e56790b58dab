"""Router-side load accounting and the online prefill-rate estimate."""

import pytest

from router.load import RATE_EWMA_ALPHA, LoadTracker


def test_in_flight_and_queued_tokens_follow_the_request_lifecycle():
    t = LoadTracker(prior_rate=1000.0)
    t.on_routed("a", "r1", uncached_tokens=500)
    t.on_routed("b", "r1", uncached_tokens=300)
    st = t.state("r1")
    assert (st.in_flight, st.queued_prefill_tokens) == (2, 800)
    assert t.on_first_token("a", ttft_s=0.5) == ("r1", 500)
    assert (st.in_flight, st.queued_prefill_tokens) == (2, 300)
    assert t.on_first_token("a", ttft_s=0.5) is None  # duplicates are ignored
    t.on_finished("a")
    t.on_finished("b")  # finished (failed) before its first token: its queued work is released too
    assert (st.in_flight, st.queued_prefill_tokens) == (0, 0)
    t.on_finished("b")
    assert st.in_flight == 0


def test_prefill_rate_learns_from_work_ahead_over_ttft():
    t = LoadTracker(prior_rate=1000.0)
    t.on_routed("a", "r", uncached_tokens=2000)
    t.on_routed("b", "r", uncached_tokens=2000)  # 2000 tokens queued ahead of it
    t.on_first_token("a", ttft_s=1.0)  # sample 2000 tok/s
    rate_after_a = 1000.0 * (1 - RATE_EWMA_ALPHA) + 2000.0 * RATE_EWMA_ALPHA
    assert t.state("r").prefill_rate == pytest.approx(rate_after_a)
    t.on_first_token("b", ttft_s=2.0)  # (2000 ahead + 2000 own) / 2 s
    assert t.state("r").prefill_rate == pytest.approx(rate_after_a * (1 - RATE_EWMA_ALPHA) + 2000.0 * RATE_EWMA_ALPHA)


def test_tiny_prefills_do_not_skew_the_rate():
    t = LoadTracker(prior_rate=1000.0)
    t.on_routed("a", "r", uncached_tokens=3)
    t.on_first_token("a", ttft_s=0.5)
    assert t.state("r").prefill_rate == 1000.0


def test_removing_a_replica_forgets_its_requests():
    t = LoadTracker()
    t.on_routed("a", "r", 10)
    t.remove("r")
    assert t.on_first_token("a", 0.1) is None
    assert t.state("r").in_flight == 0

"""Router-side load accounting and the online prefill-rate estimate."""

import pytest

from kvroute.router.placement.load import RATE_EWMA_ALPHA, RATE_STALE_S, LoadTracker


def test_in_flight_and_queued_tokens_follow_the_request_lifecycle():
    t = LoadTracker(prior_rate=1000.0)
    t.on_routed("a", "r1", uncached_tokens=500)
    t.on_routed("b", "r1", uncached_tokens=300)
    st = t.state("r1")
    assert (st.in_flight, st.queued_prefill_tokens) == (2, 800)
    assert t.on_first_token("a", ttft_s=0.5, now=0.0) == ("r1", 500)
    assert (st.in_flight, st.queued_prefill_tokens) == (2, 300)
    assert t.on_first_token("a", ttft_s=0.5, now=0.0) is None  # duplicates are ignored
    t.on_finished("a")
    t.on_finished("b")  # finished (failed) before its first token: its queued work is released too
    assert (st.in_flight, st.queued_prefill_tokens) == (0, 0)
    t.on_finished("b")
    assert st.in_flight == 0


def test_prefill_rate_is_sampled_work_over_sampled_time():
    t = LoadTracker(prior_rate=1000.0)
    assert t.state("r").prefill_rate == 1000.0  # the prior, until a sample
    t.on_routed("a", "r", uncached_tokens=2000)
    t.on_routed("b", "r", uncached_tokens=2000)  # 2000 tokens queued ahead of it
    t.on_first_token("a", ttft_s=1.0, now=1.0)  # the first sample replaces the prior: 2000 tok/s
    assert t.state("r").prefill_rate == pytest.approx(2000.0)
    t.on_first_token("b", ttft_s=4.0, now=2.0)  # (2000 ahead + 2000 own) in 4 s
    a = RATE_EWMA_ALPHA
    work, time = (1 - a) * 2000 + a * 4000, (1 - a) * 1.0 + a * 4.0
    assert t.state("r").prefill_rate == pytest.approx(work / time)


def test_a_short_prefill_weighs_what_it_took():
    """Short prefills are mostly step overhead: their per-request rates are low and noisy.  A mean
    of those rates would drag the estimate; work over time gives each the weight of its time."""
    t = LoadTracker()
    t.on_routed("long", "r", uncached_tokens=20_000)
    t.on_first_token("long", ttft_s=1.0, now=0.0)  # 20k tok/s
    t.on_routed("short", "r", uncached_tokens=100)
    t.on_first_token("short", ttft_s=0.02, now=1.0)  # 5k tok/s on its own
    assert t.state("r").prefill_rate > 15_000  # a mean of rates: 17k; falls to 5k as such samples repeat
    for i in range(40):
        t.on_routed(f"s{i}", "r", uncached_tokens=100)
        t.on_first_token(f"s{i}", ttft_s=0.02, now=2.0 + i)
    assert t.state("r").prefill_rate == pytest.approx(5000.0, rel=0.1)  # what it really serves now


def test_a_sample_after_a_long_silence_replaces_the_stale_rate():
    """A replica that got no traffic for RATE_STALE_S may have recovered (or degraded) since: its
    next sample is the rate, where an average would keep most of the old one."""
    t = LoadTracker(prior_rate=1000.0)
    for i, (at, ttft) in enumerate([(0.0, 10.0), (5.0, 10.0), (5.0 + RATE_STALE_S + 1, 0.5)]):
        t.on_routed(f"r{i}", "r", uncached_tokens=1000)
        t.on_first_token(f"r{i}", ttft_s=ttft, now=at)
    assert t.state("r").prefill_rate == pytest.approx(2000.0)  # 1000 tokens in 0.5 s, alone
    t.on_routed("late", "r", uncached_tokens=1000)
    t.on_first_token("late", ttft_s=1.0, now=5.0 + RATE_STALE_S + 2)  # soon after: averaged again
    a = RATE_EWMA_ALPHA
    assert t.state("r").prefill_rate == pytest.approx(1000.0 / ((1 - a) * 0.5 + a * 1.0))


def test_tiny_prefills_do_not_skew_the_rate():
    t = LoadTracker(prior_rate=1000.0)
    t.on_routed("a", "r", uncached_tokens=3)
    t.on_first_token("a", ttft_s=0.5, now=0.5)
    assert t.state("r").prefill_rate == 1000.0


def test_removing_a_replica_forgets_its_requests():
    t = LoadTracker()
    t.on_routed("a", "r", 10)
    t.remove("r")
    assert t.on_first_token("a", 0.1, 0.1) is None
    assert t.state("r").in_flight == 0

"""The soak's verdict (bench/soak.py): flat RSS and steady p99 pass, growth and drift fail."""

from __future__ import annotations

import pytest

from kvroute.bench.soak import Sample, analyze

RULE = dict(warmup_s=60, window_s=60)


def _run(rss_at, p99_ms_at, minutes: int = 10, failed: int = 0):
    """Samples every 5 s and 10 requests a second whose latency is 10 ms but 1 in 100 at the p99."""
    samples = [Sample(t, rss_at(t), 50, failed if t == 300 else 0, 10.0, p99_ms_at(t))
               for t in range(5, minutes * 60 + 1, 5)]
    latencies = [(i / 10, (p99_ms_at(i / 10) if i % 100 == 0 else 10.0) / 1e3) for i in range(minutes * 600)]
    return analyze(samples, latencies, **RULE)


def test_flat_run_passes_even_if_the_first_minute_grows():
    v = _run(lambda t: 80 + min(t, 60) / 6, lambda t: 40.0)  # warm-up 80 -> 90 MB, then flat
    assert v.ok and v.reasons == [] and v.rss_first_mb == v.rss_last_mb == 90


def test_steady_growth_after_the_first_minute_fails():
    v = _run(lambda t: 90 + t / 60, lambda t: 40.0)  # +1 MB a minute: ~10% over the run
    assert not v.ok and "RSS grew" in v.reasons[0]
    assert v.rss_growth_pct == pytest.approx((99.5 / 91.5 - 1) * 100, abs=0.5)


def test_p99_drift_fails_and_noise_does_not():
    assert _run(lambda t: 90, lambda t: 40.0 + (t % 50) / 10).ok  # jitter within the slack
    v = _run(lambda t: 90, lambda t: 40.0 + t / 6)  # 50 -> 140 ms
    assert not v.ok and "p99 drifted" in v.reasons[0]


def test_failed_requests_fail_and_a_short_run_is_refused():
    assert _run(lambda t: 90, lambda t: 40.0, failed=3).reasons == ["3 requests failed"]
    with pytest.raises(ValueError, match="too short"):
        _run(lambda t: 90, lambda t: 40.0, minutes=2)

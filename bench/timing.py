"""Shared timing helper of the micro-benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def per_call_us(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median and p99 wall time of one call, in microseconds, after a short warm-up."""
    for _ in range(min(200, repeat)):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]

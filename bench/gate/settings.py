"""The gate's sizes and names (docs/routing-gate.md says why each is what it is)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = "gate"
DEFAULT_POLICY = "cost_model"
POLICIES = ("cost_model", "sglang_cache_aware", "round_robin")
REPLICAS = 8
WALL_RATE = 14.0  # requests per wall second, every workload
REQUEST_TIMEOUT_S = 20.0  # a request not answered within this (wall) fails: the user gave up
# Every output token is one SSE event through three Python processes (replica, router, client):
# ~60 us each in the router and the replicas here, the gate's largest CPU cost.  Outputs are capped
# (live and simulated alike); the cap is part of each workload's load calibration.
MAX_TOKENS = 128
SPREAD_FILE = Path(__file__).resolve().parents[1] / "gate_spread.json"
# A few runs underestimate the range of a new pair's difference (four normal samples span ~2
# standard deviations; a difference of two new ones has 1.4): the verdict allows twice the
# measured spread (its square for ratios), ~4 standard deviations of the difference.
SPREAD_FACTOR = 2.0
COMPARE_PREFIX = "compare:"
SIM_PREFIX = "sim:"
TRACE_MAX_CONTEXT = 30_000  # Mooncake rows longer than this (input + output) are left out (router and replica CPU)
# The replicas serve a 128k context (Llama 3.1's; their KV cache holds 444k tokens).  Every prompt
# of the workloads fits 32k; the context matters to how a router bounds a prompt's length before
# it has counted its tokens (docs/routing-gate.md).
MAX_MODEL_LEN = 131_072
READY_TIMEOUT_S = 60.0
TTFT_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")

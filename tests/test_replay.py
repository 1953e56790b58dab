"""`kvroute bench replay` end to end: the CLI in a subprocess replays a small Mooncake-format trace
through the real router over emulated replicas; its figures must match what the replicas and the
router counted."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import numpy as np

from kvroute.bench.demo import parse_metrics, total
from kvroute.bench.demo_fleet import EmulatedFleet, demo_stack
from kvroute.bench.limit import LIMIT_KEYS
from kvroute.bench.replay import prompt_text

REPO = Path(__file__).resolve().parents[1]
TIME_SCALE = 0.05  # replicas run 20x faster than the H100 profile's real time
MAX_TOKENS = 8


def small_trace(n: int = 30) -> list[dict]:
    """Six shared 'documents' of 1-3 blocks, each request one of them plus 0-2 blocks of its own
    and a partial last block; 3 s of arrivals, outputs longer than the cap sometimes."""
    rng = np.random.default_rng(7)
    docs = [list(range(100 * d, 100 * d + int(rng.integers(1, 4)))) for d in range(6)]
    rows, own = [], 10_000
    for i in range(n):
        ids = docs[int(rng.integers(0, len(docs)))] + list(range(own, own + int(rng.integers(0, 3)) + 1))
        own += 10
        rows.append({
            "timestamp": int(i * 100),
            "input_length": 512 * (len(ids) - 1) + int(rng.integers(20, 512)),
            "output_length": int(rng.integers(1, 20)),
            "hash_ids": ids,
        })
    return rows


def expected_available(rows: list[dict]) -> float:
    """Leading 512-token blocks some earlier request had, as tokens, over the input tokens."""
    seen: set[int] = set()
    shared = 0
    for r in rows:
        m = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            m += 1
        shared += min(512 * m, r["input_length"])
        seen.update(r["hash_ids"])
    return shared / sum(r["input_length"] for r in rows)


async def replica_totals(urls: list[str]) -> dict[str, float]:
    names = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total")
    sums = dict.fromkeys(names, 0.0)
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url + "/metrics") as resp:
                samples = parse_metrics(await resp.text())
            for name in names:
                sums[name] += total(samples, name)
    return sums


async def test_replay_reports_what_the_replicas_and_the_router_saw(tmp_path):
    rows = small_trace()
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fleet = EmulatedFleet(2, model="demo", time_scale=TIME_SCALE)
    async with demo_stack("cost_model", fleet) as stack:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute.cli", "bench", "replay", "--trace", str(trace), "--url", stack.url,
            "--speedup", "10", "--max-tokens", str(MAX_TOKENS), "--session-header", "X-Session-ID",
            "--profile", "default", "--replica-time-scale", str(TIME_SCALE), "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(REPO),
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
        replicas = await replica_totals(fleet.urls)
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.url + "/metrics") as resp:
                router = parse_metrics(await resp.text())

    lines = out.decode().strip().splitlines()
    assert len(lines) == 1  # stdout is one JSON object; the progress bar went to stderr
    doc = json.loads(lines[0])
    assert (doc["requests"], doc["answered"], doc["errors"]) == (30, 30, 0)
    # The router answered the 30 requests, and the two /tokenize calls that calibrated the text.
    assert total(router, "kvroute_requests_total", model="demo", status="200") == 30 + 2
    # Token counts as the replicas booked them: every request answered once, max_tokens capped.
    assert doc["prompt_tokens"] == replicas["vllm:prompt_tokens_total"]
    assert doc["cached_tokens"] == replicas["vllm:prefix_cache_hits_total"]
    assert doc["completion_tokens"] == replicas["vllm:generation_tokens_total"] == sum(
        min(r["output_length"], MAX_TOKENS) for r in rows
    )
    assert doc["reuse_delivered"] == doc["cached_tokens"] / doc["prompt_tokens"]
    # Available reuse from the hash ids; the trace's shared documents were delivered as cache hits.
    assert doc["reuse_available"] == expected_available(rows) > 0.3
    assert 0.5 * doc["reuse_available"] < doc["reuse_delivered"] <= doc["reuse_available"] + 0.02
    # Blocks of about 512 tokens through the router's real tokenizer (calibrated on /tokenize).
    assert doc["tokens_per_word"] is not None
    assert abs(doc["prompt_tokens"] / doc["input_tokens"] - 1) < 0.05
    # The physical limit, scaled to the replicas' speed, is below every percentile measured.
    assert set(doc["limit"]) == set(LIMIT_KEYS)
    assert all(0 < doc["limit"][k] <= doc[k] for k in LIMIT_KEYS)
    assert all(doc["ttft_vs_limit"][k] >= 1 for k in LIMIT_KEYS)


def test_prompt_text_shares_exactly_the_shared_blocks():
    a = {"hash_ids": [1, 2, 3], "input_length": 1300}
    b = {"hash_ids": [1, 2, 4], "input_length": 1536}
    ta, tb = prompt_text(a, 100), prompt_text(b, 100)
    blocks_a, blocks_b = ta.split("\n"), tb.split("\n")
    assert blocks_a[:2] == blocks_b[:2] and blocks_a[2] != blocks_b[2]
    assert [len(x.split()) for x in blocks_b[:3]] == [100, 100, 100]
    assert len(blocks_a[2].split()) == round(100 * (1300 - 1024) / 512)  # the partial last block
    assert blocks_b[2].split()[:10] != blocks_a[2].split()[:10]


def test_a_failed_request_counts_in_the_ttft_percentiles_as_the_give_up_time():
    """Left out, the requests a router fails (its slowest) would improve its tail: a router that
    times out 2 of 10 requests must show a p90 of at least the give-up time."""
    from kvroute.bench.demo_chat import RequestRecord
    from kvroute.bench.replay import ReplayResult, summarize

    rows = small_trace(10)
    records = [RequestRecord(f"s{i}", i, 0.0, ttft_s=0.1, prompt_tokens=r["input_length"]) for i, r in enumerate(rows)]
    for r in records[:2]:
        r.ttft_s, r.error = float("nan"), "timeout"
    result = ReplayResult(rows, records, 1.0, 100, None)
    counted = summarize(result, give_up_s=20.0)
    answered = summarize(result)
    assert counted["errors"] == 2 and counted["answered"] == 8
    assert counted["ttft_p90_s"] >= 20.0 and counted["ttft_p50_s"] == 0.1
    assert answered["ttft_p90_s"] == 0.1  # the old, survivors-only view
    assert counted["answered_ttft"]["ttft_p99_s"] == 0.1
    from kvroute.bench.sim_cli import resolve_profile

    limited = summarize(result, resolve_profile("llama3-8b-h100"), give_up_s=20.0)  # failed rows' limits from the trace
    assert limited["limit"]["ttft_p90_s"] > 0 and limited["ttft_vs_limit"]["ttft_p90_s"] > 1

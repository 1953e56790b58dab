"""The live routing gate end to end on a tiny workload (bench/routing_gate.py, its parts in bench/gate/): the fleet process,
a real router process per run (this checkout's, and the same checkout as --compare), the real
replay in its own process, the simulator beside it, the verdict; and `kvroute bench replay` on a
generated chat workload, whose reuse figures must be what the replicas and the token ids say."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp

from kvroute.bench.demo import parse_metrics, total
from kvroute.bench.demo_fleet import EmulatedFleet, demo_stack
from kvroute.bench.limit import LIMIT_KEYS, available_blocks, chains_of
from kvroute.bench.gate.settings import COMPARE_PREFIX
from kvroute.bench.gate.verdict import ENGINE_KEYS, METRICS, measure_spread, verdict
from kvroute.replica.assets import TINY_TOKENIZER
from kvroute.common.tokens import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_the_gate_runs_routers_replay_and_simulator_and_gives_a_verdict(tmp_path):
    spread = tmp_path / "spread.json"
    spread.write_text(json.dumps({"default": {m: 0.5 if m == "reuse" else 100.0 for m in METRICS}}))
    out = tmp_path / "gate.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "bench", "gate", "--workloads", "conversation", "--policies", "cost_model",
         "--replicas", "3", "--requests-scale", "0.06", "--compare", str(REPO), "--spread", str(spread),
         "--json", str(out), "--out", str(tmp_path / "gate"), "--strict", "--records"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    doc = json.loads(out.read_text())
    w = doc["workloads"]["conversation"]
    n = w["workload"]["requests"]
    assert n == 12
    assert set(w["configs"]) == {"cost_model", COMPARE_PREFIX + "cost_model"}
    for name, fig in w["configs"].items():
        assert (fig["requests"], fig["answered"], fig["errors"]) == (n, n, 0), name
        assert fig["prompt_tokens_mismatched"] == 0  # the replicas counted the tokens the gate encoded
        assert 0 < fig["reuse_delivered"] <= fig["reuse_available"] + 0.01
        assert all(0 < fig["limit"][k] <= fig[k] for k in LIMIT_KEYS)
        assert sum(fig["requests_per_replica"].values()) == n  # the router's own count, scraped
        assert len(fig["records"]) == n and all(r["ttft_s"] > 0 for r in fig["records"])
        assert fig["cpu_s"]["router"] > 0
        engine = fig["engine"]  # the replicas' own TTFTs: below the client's, above the limit
        assert engine["first_tokens"] == n
        assert all(fig["limit"][k] * 0.99 <= engine[k] <= fig[k] for k in LIMIT_KEYS)
    assert set(w["sim"]) == {"sim:cost_model"} and w["sim"]["sim:cost_model"]["answered"] == n
    # the same code on both sides, inside a generous spread: no regression (and --strict exits 0)
    assert w["verdict"] is not None and w["verdict"]["regression"] is False
    assert set(w["verdict"]["deltas"]) == set(METRICS)
    assert "conversation" in proc.stdout and "OK" in proc.stdout


def fig(reuse: float, p50: float, p90: float, p99: float, errors: int = 0) -> dict:
    return {"delivered_share_of_available": reuse, "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99, "errors": errors}


def test_verdict_flags_a_loss_beyond_the_spread_and_only_that():
    # allowed: twice the spread, its square for ratios (reuse 4 pts, p50 +69%, p90 +44%, p99 +44%, 2 errors)
    spread = {"default": {"reuse": 0.02, "ttft_p50_s": 0.3, "ttft_p90_s": 0.2, "ttft_p99_s": 0.2, "errors": 1},
              "workloads": {"w": {"ttft_p90_s": 0.5}}}
    base = fig(0.90, 1.0, 2.0, 3.0)
    same = verdict("w", {"cost_model": fig(0.87, 1.6, 4.4, 4.2), COMPARE_PREFIX + "cost_model": base}, spread)
    assert same is not None and not same["regression"]  # within every allowance (p90's is the workload's own)
    worse = verdict("x", {"cost_model": fig(0.85, 1.0, 3.0, 3.0), COMPARE_PREFIX + "cost_model": base}, spread)
    assert worse is not None and worse["regression"]
    assert [w.split()[0] for w in worse["worse"]] == ["reuse", "p90"]
    errs = verdict("w", {"cost_model": fig(0.9, 1.0, 2.0, 3.0, errors=3), COMPARE_PREFIX + "cost_model": base}, spread)
    assert errs is not None and errs["regression"] and errs["worse"][0].startswith("errors 3 vs 0")
    two = verdict("w", {"cost_model": fig(0.9, 1.0, 2.0, 3.0, errors=2), COMPARE_PREFIX + "cost_model": base}, spread)
    assert two is not None and not two["regression"]  # two errors more are within this allowance
    assert verdict("w", {"cost_model": base}, spread) is None  # nothing to compare with
    # a run on a machine busier than any of the spread's runs: timings measure the machine; reuse still counts
    busy = {**spread, "max_others_cores": 0.5}
    slow_busy = {**fig(0.90, 3.0, 6.0, 9.0, errors=5), "cpu_s": {"others_cores": 1.4}}
    b = verdict("x", {"cost_model": slow_busy, COMPARE_PREFIX + "cost_model": base}, busy)
    assert b is not None and not b["regression"] and "only reuse judged" in b["note"]
    lost = verdict("x", {"cost_model": {**slow_busy, "delivered_share_of_available": 0.85},
                         COMPARE_PREFIX + "cost_model": base}, busy)
    assert lost is not None and lost["regression"] and lost["worse"][0].startswith("reuse")


def test_spread_is_the_largest_difference_between_runs_of_the_same_code(tmp_path):
    paths = []
    for k, (a, b) in enumerate([(fig(0.90, 1.0, 2.0, 4.0), fig(0.92, 1.5, 2.2, 4.0)), (fig(0.91, 1.2, 2.4, 4.4), fig(0.93, 1.1, 2.1, 4.1))]):
        p = tmp_path / f"g{k}.json"
        p.write_text(json.dumps({"workloads": {"w": {"configs": {"cost_model": a, COMPARE_PREFIX + "cost_model": b}}}}))
        paths.append(p)
    s = measure_spread(paths)
    assert s["samples_per_workload"] == {"w": 4}
    assert s["workloads"]["w"] == {"reuse": 0.03, "ttft_p50_s": 0.5, "ttft_p90_s": 0.2, "ttft_p99_s": 0.1, "errors": 0}
    assert s["max_others_cores"] == 0.0


async def test_replay_of_a_generated_chat_workload_reports_what_the_replicas_and_the_ids_say():
    fleet = EmulatedFleet(2, model="demo", time_scale=0.05)
    async with demo_stack("cost_model", fleet) as stack:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute.cli", "bench", "replay", "--workload", "handbook", "--requests", "12",
            "--url", stack.url, "--speedup", "4", "--max-tokens", "8", "--profile", "default",
            "--replica-time-scale", "0.05", "--json", "--records",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(REPO))
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
        cached = 0.0
        async with aiohttp.ClientSession() as http:
            for url in fleet.urls:
                async with http.get(url + "/metrics") as resp:
                    cached += total(parse_metrics(await resp.text()), "vllm:prefix_cache_hits_total")
    doc = json.loads(out)
    assert (doc["kind"], doc["requests"], doc["answered"], doc["errors"]) == ("chat", 12, 12, 0)
    from kvroute.bench.chat_workloads import rows

    tok = Tokenizer.from_dir(TINY_TOKENIZER)
    ids = [tok.encode_chat(r["messages"]) for r in rows("handbook", 0, 12)]
    seen = available_blocks(chains_of(ids, 16))
    assert doc["reuse_available"] == sum(min(16 * m, len(p)) for m, p in zip(seen, ids)) / sum(map(len, ids))
    assert doc["reuse_available"] > 0.8  # one shared document
    assert doc["prompt_tokens"] == sum(map(len, ids)) and doc["prompt_tokens_mismatched"] == 0
    assert doc["cached_tokens"] == cached > 0
    assert [r["available_tokens"] for r in doc["records"]] == [min(16 * m, len(p)) for m, p in zip(seen, ids)]

"""`kvroute demo`: the comparison's JSON (shape, counts, consistency between router and client),
`--serve` as a real process (URL first, /ready, /v1/models, the openai client, clean SIGINT stop),
interruption, and the chat workload it replays."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import json
import os
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest

from kvroute.bench import demo, sim_cli
from kvroute.bench.demo_chat import ChatConfig, build_workload
from kvroute.bench.demo_fleet import fleet_factory, make_fleet, resets_in_place
from kvroute.bench.limit import LIMIT_KEYS
from kvroute.bench.sim import METRIC_KEYS

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--replicas", "3", "--sessions", "6", "--session-rate", "20", "--time-scale", "0.05", "--seed", "1"]


def listening_sockets_of_this_process() -> set[int]:
    """Inodes of the TCP sockets this process holds in LISTEN state (Linux /proc)."""
    listening: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening.add(int(fields[9]))
    mine: set[int] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    return listening & mine


def sim_json_keys() -> tuple[set[str], set[str]]:
    """Top-level and per-policy keys of `kvroute sim --json`, from a tiny real run."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert sim_cli.main(["--workload", "sessions", "--requests", "20", "--replicas", "2", "--policy", "round_robin", "--json"]) == 0
    doc = json.loads(out.getvalue())
    return set(doc), set(doc["policies"]["round_robin"])


def test_demo_json_has_the_sim_keys_and_counts_every_request(capsys):
    before = listening_sockets_of_this_process()
    assert demo.main([*SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON object, got {captured.out!r}"
    doc = json.loads(lines[0])

    sim_top, sim_policy = sim_json_keys()
    assert sim_top <= set(doc) and doc["kv_events"] is True
    limit = doc["limit"]  # emulated replicas: their profile gives the physical limit
    assert set(limit) == set(LIMIT_KEYS) and 0 < limit["ttft_p50_s"] <= limit["ttft_p90_s"] <= limit["ttft_p99_s"]
    assert set(doc["policies"]) == {"round_robin", "cost_model"}
    sent = build_workload(1, 6, 20.0, ChatConfig()).requests
    assert doc["requests_sent"] == sent
    for name, m in doc["policies"].items():
        assert set(m) == sim_policy == set(METRIC_KEYS), name
        assert m["requests"] == sent, name  # every request answered and counted once
        for key in ("reuse_available", "reuse_predicted", "reuse_delivered"):
            assert 0.0 <= m[key] <= 1.0, (name, key, m[key])
        assert 0.0 < m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["ttft_p99_s"], name
        assert all(m[k] >= limit[k] for k in LIMIT_KEYS), name  # no router beats the limit
        assert m["imbalance"] >= 1.0 and m["throughput_rps"] > 0, name
        details = doc["passes"][name]
        assert details["errors"] == 0 and details["sent"] == sent
        assert sum(details["requests_per_replica"]) == sent  # the router's count matches the client's
        # delivered as the client summed cached_tokens == as the router's counter booked them
        assert details["router_delivered_tokens"] == round(m["reuse_delivered"] * details["prompt_tokens"])
        assert details["kv_events_applied"] > 0, name  # the router follows the replicas' events (no Redis)
    # Multi-turn sessions re-send their history: an earlier prompt always shares a prefix.
    assert doc["policies"]["cost_model"]["reuse_available"] > 0.5
    # Same seed, same text, cold fleets: both passes see the same prompts.
    assert doc["policies"]["round_robin"]["reuse_available"] == pytest.approx(
        doc["policies"]["cost_model"]["reuse_available"], abs=0.02
    )
    assert "round_robin" in captured.err  # progress goes to stderr
    assert listening_sockets_of_this_process() == before  # nothing left listening


def child_processes() -> set[int]:
    """Live children of this process, from /proc (every thread's list)."""
    children: set[int] = set()
    for path in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children.update(int(pid) for pid in path.read_text().split())
    return children


def test_engine_vllm_builds_a_fleet_of_real_replicas_and_building_starts_nothing():
    before = child_processes()
    fleet = make_fleet("vllm", 2, model="demo", time_scale=0.5, profile="default")
    assert fleet_factory("vllm") is importlib.import_module("kvroute.replica.vllm").demo_fleet
    assert (fleet.model, fleet.urls) == ("demo", [])
    assert "2 vLLM replicas" in fleet.describe() and "no timing profile" in fleet.describe()
    assert resets_in_place(fleet)  # one start for both passes, caches emptied before each
    assert not resets_in_place(make_fleet("emulated", 2, model="demo", time_scale=0.5))  # a fresh fleet per pass
    assert child_processes() == before  # no launcher, no vLLM, no install


def test_engine_defaults_emulated_unchanged_vllm_smaller():
    emulated = demo.parse_args([])
    assert (emulated.replicas, emulated.sessions, emulated.session_rate, emulated.time_scale) == (4, 160, 8.0, 0.5)
    assert emulated.chat == ChatConfig()
    vllm = demo.parse_args(["--engine", "vllm"])
    assert (vllm.replicas, vllm.sessions, vllm.session_rate, vllm.time_scale) == (2, 40, 1.0, 1.0)
    assert vllm.chat.turns[0] >= 3  # multi-turn: later turns re-send what an earlier one cached
    assert demo.parse_args(["--engine", "vllm", "--serve"]).time_scale == demo.SERVE_TIME_SCALE
    assert demo.parse_args(["--engine", "vllm", "--replicas", "3"]).replicas == 3


def test_vllm_workload_fits_the_tiny_models_context():
    """The longest prompt of the default --engine vllm workload (every user turn, and replies
    counted at twice their max_tokens) stays within the tiny model's context: vLLM would
    answer a longer one with HTTP 400."""
    from tokenizers import Tokenizer

    from kvroute.replica.tiny_model import ModelShape

    tok = Tokenizer.from_file(str(REPO / "tests" / "assets" / "tiny-tokenizer" / "tokenizer.json"))
    args = demo.parse_args(["--engine", "vllm"])
    workload = build_workload(args.seed, args.sessions, args.session_rate, args.chat)
    system = [len(tok.encode(text).ids) for text in workload.system_prompts]
    longest = 0
    for conv in workload.conversations:
        tokens = system[conv.system]
        for turn in conv.turns:
            tokens += len(tok.encode(turn.user_text).ids) + 8  # + the chat template's markers
            longest = max(longest, tokens + turn.max_tokens)
            tokens += 2 * turn.max_tokens
    assert 3000 < longest < ModelShape().max_position_embeddings


def test_bad_options_are_rejected():
    for argv in (["--replicas", "0"], ["--time-scale", "0"], ["--profile", "no-such-profile"]):
        with pytest.raises(SystemExit) as exc:
            demo.parse_args(argv)
        assert exc.value.code == 2


async def _start_demo(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "demo", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(REPO),
    )


async def _line(stream: asyncio.StreamReader, timeout: float = 30.0) -> str:
    return (await asyncio.wait_for(stream.readline(), timeout)).decode().strip()


async def kv_events_applied(url: str, timeout_s: float = 10.0) -> float:
    """The router's kvroute_kv_events_applied_total, once above 0 (or 0 after ``timeout_s``)."""
    from prometheus_client.parser import text_string_to_metric_families

    applied = 0.0
    async with aiohttp.ClientSession() as http:
        for _ in range(int(timeout_s / 0.1)):
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            applied = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                          if s.name == "kvroute_kv_events_applied_total")
            if applied:
                break
            await asyncio.sleep(0.1)
    return applied


def _port_refuses(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


async def test_serve_prints_its_url_first_serves_openai_and_stops_cleanly_on_sigint():
    proc = await _start_demo("--serve", "--replicas", "2")
    assert proc.stdout is not None and proc.stderr is not None
    try:
        url = await _line(proc.stdout)
        assert url.startswith("http://127.0.0.1:"), url
        assert await _line(proc.stdout) == f"metrics: {url}/metrics"
        replica_urls = []
        for _ in range(2):
            line = await _line(proc.stdout)
            assert line.startswith("replica: http://"), line
            replica_urls.append(line.split()[1])
            # each publishes KV events on ports of its own, which the router is told (no Redis)
            assert f"(metrics: {replica_urls[-1]}/metrics, KV events: tcp://127.0.0.1:" in line, line

        async with aiohttp.ClientSession() as http:
            for path in ("/ready", "/health"):
                async with http.get(url + path) as resp:
                    assert resp.status == 200, path
            async with http.get(url + "/metrics") as resp:
                assert resp.status == 200 and "kvroute_requests_total" in await resp.text()
            async with http.get(replica_urls[0] + "/metrics") as resp:
                assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["demo"]
            chat = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hello there, router. " * 20}], max_tokens=4
            )
            assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
            stream = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "And again."}], max_tokens=3, stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        finally:
            await client.close()
        assert await kv_events_applied(url) > 0  # the replicas' BlockStored events reached the index


        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    for u in (url, *replica_urls):
        assert _port_refuses(u), f"{u} still accepts connections"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
async def test_comparison_interrupted_mid_run_stops_everything(sig):
    proc = await _start_demo("--replicas", "2", "--sessions", "40", "--session-rate", "2", "--time-scale", "0.5")
    assert proc.stdout is not None and proc.stderr is not None
    try:
        header = await _line(proc.stderr)
        assert header.startswith("kvroute demo:"), header
        await asyncio.sleep(1.5)  # the first pass is replaying
        proc.send_signal(sig)
        assert await asyncio.wait_for(proc.wait(), 20) == 130
        assert b"interrupted" in await proc.stderr.read()
        assert await proc.stdout.read() == b""  # no table from a half-run comparison
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_workload_is_deterministic_with_shared_system_prompts_and_growing_turns():
    cfg = ChatConfig()
    a = build_workload(7, 30, 5.0, cfg)
    assert a == build_workload(7, 30, 5.0, cfg)
    assert a.conversations[0] != build_workload(8, 30, 5.0, cfg).conversations[0]
    assert len(a.system_prompts) == cfg.system_prompts
    used = [c.system for c in a.conversations]
    assert max(used.count(i) for i in set(used)) > 1  # a system prompt opens several sessions
    starts = [c.start_s for c in a.conversations]
    assert starts[0] == 0.0 and starts == sorted(starts)
    for c in a.conversations:
        assert cfg.turns[0] <= len(c.turns) <= cfg.turns[1]
        assert c.turns[0].think_s == 0.0
        assert all(cfg.think_min_s <= t.think_s <= cfg.think_max_s for t in c.turns[1:])
        assert all(cfg.reply_tokens[0] <= t.max_tokens <= cfg.reply_tokens[1] for t in c.turns)
        first, *later = (len(t.user_text.split()) for t in c.turns)
        assert cfg.first_message_bounds[0] <= first <= cfg.first_message_bounds[1]
        assert all(cfg.message_bounds[0] <= n <= cfg.message_bounds[1] for n in later)
    # A conversation does not depend on how many others are built.
    assert build_workload(7, 5, 5.0, cfg).conversations[3].turns == a.conversations[3].turns


def test_serve_on_a_port_in_use_exits_2_and_leaves_nothing_listening(capsys):
    before = listening_sockets_of_this_process()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        during = listening_sockets_of_this_process()
        assert demo.main(["--serve", "--replicas", "2", "--port", str(port)]) == 2
        assert listening_sockets_of_this_process() == during  # the replicas it started are stopped
    assert capsys.readouterr().out == ""  # no URL: nothing to connect to
    assert listening_sockets_of_this_process() == before


@pytest.mark.parametrize("engine", ["emulated", "vllm"])
def test_conversation_workload_is_heavy_tailed_and_fits_the_replicas_context(engine):
    """`--workload conversation`: deterministic, system prompts of several sizes, long-tailed
    conversations, minutes between turns (cut at the demo's limit), and the longest prompt
    (replies counted at twice their max_tokens) within the replicas' context."""
    from tokenizers import Tokenizer

    from kvroute.bench.demo_chat import build_conversation_workload
    from kvroute.replica.tiny_model import ModelShape

    args = demo.parse_args(["--workload", "conversation", "--engine", engine])
    cfg = args.chat
    workload = build_conversation_workload(args.seed, args.sessions, args.session_rate, cfg)
    assert workload == build_conversation_workload(args.seed, args.sessions, args.session_rate, cfg)
    tok = Tokenizer.from_file(str(REPO / "tests" / "assets" / "tiny-tokenizer" / "tokenizer.json"))
    system = [len(tok.encode(text).ids) for text in workload.system_prompts]
    assert max(system) > 4 * min(system)  # several sizes
    used = {c.system for c in workload.conversations}
    assert len(used) >= 3
    thinks = [t.think_s for c in workload.conversations for t in c.turns[1:]]
    assert min(thinks) >= cfg.shape.think_s.lo and max(thinks) == cfg.think_max_s and np.median(thinks) > 20
    sizes = sorted(workload.conversations, key=lambda c: sum(len(t.user_text) for t in c.turns))
    assert len(sizes[-1].turns) >= 1
    longest = 0
    for conv in sizes[-3:]:  # the three with the most text
        tokens = system[conv.system]
        for turn in conv.turns:
            tokens += len(tok.encode(turn.user_text).ids) + 8
            longest = max(longest, tokens + turn.max_tokens)
            tokens += 2 * turn.max_tokens
    context = 32768 if engine == "emulated" else ModelShape().max_position_embeddings
    assert 0.2 * context < longest < context
